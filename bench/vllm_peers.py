"""vLLM with our drafter service against vLLM's own n-gram drafting and no speculation.

Runs in .venv-vllm (scripts/setup_vllm.sh):

    .venv-vllm/bin/python bench/vllm_peers.py [--sets mt_bench,code] [--prompts 8]
        [--max-tokens 64] [--batch-sizes 1,8] [--modes none,ngram,sssd] [--k 4] [--budget 16]
        [--datastore DIR] [--out bench/results/vllm-peers.jsonl]

The model is the default SmolLM2-135M-Instruct in float32, as a model directory assembled from
this project's converted-weights and tokenizer caches (run anything that loads the model in .venv
once first). Mode sssd starts an `sssd-drafter` service on 127.0.0.1 over the datastore (default:
the ShareGPT one `sssd up` builds under var/demo-datastore) and gives vLLM
`sssd.vllm.proposer.SssdProposer` as its custom_class proposer. Each (mode, set, batch size)
runs in its own process (a fresh vLLM engine), greedy; outputs are compared with mode none's.
Prints one JSON line per run: tokens/s, speedup over none, drafts, accepted tokens, acceptance
length (1 + accepted / drafts, per verification step that had a draft), identical outputs.

vLLM's `suffix` method needs the arctic-inference package, which has no CPU build here: not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "vllm-peers-result: "  # marks the worker's line among vLLM's own output
MODES = {
    "none": None,
    "ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k,
                        "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "sssd": lambda k: {"method": "custom_class", "num_speculative_tokens": k,
                       "model": "sssd.vllm.proposer.SssdProposer"},
}


def model_dir(into: Path) -> Path:
    """A Hugging Face directory of the default model from this project's caches."""
    from sssd.common.model_files import resolve_model
    from sssd.common.model_loader import model_cache_dir
    from sssd.common.tokenizer import tokenizer_cache_dir

    files = resolve_model(None)
    weights, tokenizer = model_cache_dir(files), tokenizer_cache_dir(files)
    if not (weights / "model.safetensors").is_file() or not tokenizer.is_dir():
        raise SystemExit("no converted default model in the cache: load it once with .venv "
                         "(e.g. .venv/bin/sssd-generate --help after scripts/setup.sh)")
    into.mkdir(parents=True, exist_ok=True)
    for source in (weights, tokenizer):
        for path in source.iterdir():
            if path.is_file() and path.name != "sssd-complete":
                shutil.copy(path, into / path.name)
    return into


def prompt_ids(model: Path, set_name: str, limit: int) -> list[list[int]]:
    sys.path.insert(0, str(ROOT / "bench"))
    from prompt_sets import prompt_texts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for text in prompt_texts(set_name, limit):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def worker(args: argparse.Namespace) -> None:
    """One engine, one run; prints its JSON and writes the outputs to args.outputs."""
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.prompts_file).read_text())
    spec = MODES[args.mode]
    llm = LLM(model=args.model, dtype="float32", max_model_len=1024, enforce_eager=True,
              max_num_seqs=args.batch_size, disable_log_stats=False,
              speculative_config=spec(args.k) if spec else None)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4))
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    seconds = time.perf_counter() - start
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    Path(args.outputs).write_text(json.dumps(tokens))
    print(RESULT + json.dumps({"seconds": seconds, "tokens": sum(map(len, tokens)),
                      "drafts": metrics.get("vllm:spec_decode_num_drafts") or 0,
                      "draft_tokens": metrics.get("vllm:spec_decode_num_draft_tokens") or 0,
                      "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens") or 0}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_drafter(datastore: str, port: int) -> subprocess.Popen:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    drafter = subprocess.Popen(
        [str(Path(sys.executable).with_name("sssd-drafter")), "--datastore-dir", datastore,
         "--vocab-size", "49152", "--port", str(port), "--num-threads", "1"],
        stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                if health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return drafter
        except grpc.RpcError:
            time.sleep(0.5)
    drafter.kill()
    raise SystemExit("the drafter service did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="mt_bench,code")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--modes", default="none,ngram,sssd")
    parser.add_argument("--k", type=int, default=4, help="vLLM's num_speculative_tokens")
    parser.add_argument("--budget", type=int, default=16, help="draft-tree nodes asked per step")
    parser.add_argument("--datastore", default=None)
    parser.add_argument("--out", default=str(ROOT / "bench/results/vllm-peers.jsonl"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--outputs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="vllm-peers-"))
    model = model_dir(work / "model")
    datastore = args.datastore or next(
        (str(p) for p in sorted((ROOT / "var/demo-datastore").glob("*"))
         if (p / "manifest.json").is_file()), None)
    modes = args.modes.split(",")
    drafter = None
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    if "sssd" in modes:
        if datastore is None:
            raise SystemExit("no datastore: pass --datastore or run sssd up once")
        port = free_port()
        drafter = start_drafter(datastore, port)
        env.update(SSSD_VLLM_DRAFTER=f"127.0.0.1:{port}", SSSD_VLLM_BUDGET=str(args.budget))
    rows = []
    try:
        for set_name in args.sets.split(","):
            prompts_file = work / f"{set_name}.json"
            prompts_file.write_text(json.dumps(prompt_ids(model, set_name, args.prompts)))
            for batch_size in map(int, args.batch_sizes.split(",")):
                baseline = None
                for mode in modes:
                    outputs = work / f"out-{set_name}-{batch_size}-{mode}.json"
                    done = subprocess.run(
                        [sys.executable, __file__, "--worker", "--mode", mode, "--batch-size",
                         str(batch_size), "--model", str(model), "--prompts-file",
                         str(prompts_file), "--outputs", str(outputs), "--k", str(args.k),
                         "--max-tokens", str(args.max_tokens)],
                        env=env, capture_output=True, text=True, timeout=1800)
                    if done.returncode != 0:
                        raise SystemExit(f"{mode} b={batch_size} failed:\n{done.stderr[-3000:]}")
                    run = json.loads(next(line[len(RESULT):] for line in done.stdout.splitlines()
                                          if line.startswith(RESULT)))
                    tokens = json.loads(outputs.read_text())
                    if mode == "none":
                        baseline = (run, tokens)
                    row = {"set": set_name, "batch_size": batch_size, "mode": mode,
                           "datastore": datastore if mode == "sssd" else None, "k": args.k,
                           "tokens_per_s": run["tokens"] / run["seconds"],
                           "drafts": run["drafts"], "accepted": run["accepted"],
                           "acceptance_length": 1 + run["accepted"] / run["drafts"]
                           if run["drafts"] else None,
                           "draft_acceptance_rate": run["accepted"] / run["draft_tokens"]
                           if run["draft_tokens"] else None}
                    if baseline is not None:
                        base_run, base_tokens = baseline
                        row["speedup"] = row["tokens_per_s"] / (base_run["tokens"]
                                                                / base_run["seconds"])
                        row["identical_to_none"] = tokens == base_tokens
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        if drafter is not None:
            drafter.terminate()
            drafter.wait(10)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
