"""A long context's prefill and plain decode step on two builds of sssd._kernels, side by side:
SmolLM2-135M in bfloat16, b = 1, one sequence of N random prompt tokens per context. The time
to its first token (cold, the prefill) and the median of 5 rounds of 10 decode steps, beside
the step's streaming floor: the weights and the keys and values a step reads, at the speed
read_bytes streams this machine's memory (measured in the same process).

    .venv/bin/python bench/results/2026-12-03-xeon-attention/decode_ab.py \\
        [--kernels PATH/_kernels.cpython-311-x86_64-linux-gnu.so] [--label baseline] \\
        [--contexts 300,2000,8000]

--kernels loads that build of the module as sssd._kernels before anything imports it (the
build of an earlier commit, runs.sh), so both builds run the same Python. One JSON line per
context."""
import argparse
import json
import random
import statistics
import subprocess
import time

from old_kernels import use_kernels  # beside this script

parser = argparse.ArgumentParser()
parser.add_argument("--kernels", help="another build of sssd._kernels to load")
parser.add_argument("--label", default=subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    help="what the lines call this build (default: the checkout's commit)")
parser.add_argument("--contexts", default="300,2000,8000")
args = parser.parse_args()
if args.kernels:
    use_kernels(args.kernels)

import torch  # noqa: E402

from sssd import _kernels  # noqa: E402
from sssd.common.model.loader import load_causal_lm  # noqa: E402
from sssd.verifier.engine import EngineConfig  # noqa: E402
from sssd.verifier.engine.request import GenerateRequest  # noqa: E402
from sssd.verifier.factory import build_engine  # noqa: E402

stream = torch.ones(256 * 1024 * 1024, dtype=torch.bfloat16)
reads = []
for _ in range(5):
    start = time.perf_counter()
    _kernels.read_bytes(stream.data_ptr(), stream.numel() * 2)
    reads.append(time.perf_counter() - start)
stream_gb_s = stream.numel() * 2 / min(reads) / 1e9  # the fastest read: a floor
del stream

model = load_causal_lm(None, "bfloat16")
weight_bytes = sum(p.numel() * p.element_size() for p in model.model.parameters())
config = model.model.config
kv_bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads
                      * (config.hidden_size // config.num_attention_heads) * 2)
rng = random.Random(0)
for context in (int(c) for c in args.contexts.split(",")):
    engine = build_engine(EngineConfig(mode="ar", dtype="bfloat16"), model)
    prompt = tuple(rng.randrange(100, 30000) for _ in range(context))
    start = time.perf_counter()
    seq = engine.add_request(GenerateRequest(prompt, 80, ignore_eos=True))
    while not seq.output_ids:
        engine.step()
    ttft = time.perf_counter() - start
    for _ in range(5):
        engine.step()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            engine.step()
        rounds.append((time.perf_counter() - start) / 10)
    step_ms = statistics.median(rounds) * 1e3
    floor_ms = (weight_bytes + kv_bytes_per_token * (context + 15)) / (stream_gb_s * 1e9) * 1e3
    print(json.dumps({"kernels": args.label, "context": context, "ttft_s": round(ttft, 3),
                      "step_ms": round(step_ms, 2), "floor_ms": round(floor_ms, 2),
                      "step_over_floor": round(step_ms / floor_ms, 2),
                      "stream_gb_s": round(stream_gb_s, 1),
                      "threads": torch.get_num_threads()}), flush=True)
    del engine
