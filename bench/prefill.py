"""Prefill speed: the time to the first token of one prompt alone, by prompt length, for the
engine and for vLLM's CPU build on the same model, dtype and machine.

    .venv/bin/python bench/prefill.py [--models smollm2,qwen-coder-1.5b] [--dtype bfloat16]
        [--lengths 128,256,512,1024,2000] [--repeats 3] [--rounds 2]
        [--systems engine,engine-whole,vllm] [--out bench/results/prefill.jsonl]

Systems, each a process of its own; every round runs each system once, in turn, so that all
of them see the same machine:
- engine: the engine's own forward pass, prompts prefilled in chunks of its default
  max_num_batched_tokens (a chunk's attention: chains of tree nodes, kernel_paths'
  tree_attention path);
- engine-whole: the same with each prompt in one chunk (what chunking costs a lone prompt);
- vllm: vLLM's CPU build (.venv-vllm), `LLM.generate` with max_tokens 1, every core.
A measurement is one request of `length` random token ids (new ones each time, the same for
every system: no prefix cache can answer them) to its first token, the median of --repeats,
after a warm-up prompt of every length. Where a system's rounds differ, the median of rounds.

One JSON line per (model, length, system), with the speed against vLLM where it ran and, for
the engine, the attention path its chunks ran.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import flags
from bench.engine_speed import VLLM_PYTHON, cpu_name, model_file

ROOT = Path(__file__).resolve().parents[1]
RESULT = "prefill-result: "
SYSTEMS = ("engine", "engine-whole", "vllm")


def prompts(lengths: list[int], repeats: int, vocab: int = 30_000) -> dict[int, list[list[int]]]:
    """`repeats` prompts of random token ids per length, seeded: every system gets the same."""
    rng = random.Random(0)
    return {n: [[rng.randrange(100, vocab) for _ in range(n)] for _ in range(repeats + 1)]
            for n in lengths}


def engine_worker(args: argparse.Namespace, cases: dict[int, list[list[int]]]):
    from sssd.common.model.loader import load_causal_lm
    from sssd.verifier.engine import EngineConfig
    from sssd.verifier.factory import build_engine

    loaded = load_causal_lm(args.model_file, args.dtype)
    chunk = {"max_num_batched_tokens": max(cases)} if args.system == "engine-whole" else {}
    engine = build_engine(EngineConfig(mode="ar", dtype=args.dtype, max_batch_size=1,
                                       max_len=max(cases) + 8, enable_prefix_caching=False,
                                       **chunk), loaded)

    def first_token(ids: list[int]) -> None:
        engine.generate([ids], 1)
    return first_token, engine.runner


def vllm_worker(args: argparse.Namespace, cases: dict[int, list[list[int]]]):
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.vllm_model, dtype=args.dtype, max_model_len=max(cases) + 8,
              max_num_seqs=1)
    one = SamplingParams(temperature=0, max_tokens=1)

    def first_token(ids: list[int]) -> None:
        llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
    return first_token, None


def worker(args: argparse.Namespace) -> None:
    cases = {int(n): p for n, p in json.loads(Path(args.prompts_file).read_text()).items()}
    # run(ids): one prompt to its first token; runner: the engine's model runner
    run, runner = vllm_worker(args, cases) if args.system == "vllm" \
        else engine_worker(args, cases)
    for batch in cases.values():
        run(batch[0])  # warm-up: every length once
    result = {}
    for length, batch in cases.items():
        seconds = []
        for ids in batch[1:]:
            start = time.perf_counter()
            run(ids)
            seconds.append(time.perf_counter() - start)
        result[length] = statistics.median(seconds)
    print(RESULT + json.dumps({"seconds": result, "attention":
                               None if runner is None else runner.attention_path}), flush=True)


def run_system(args: argparse.Namespace, system: str, model: str, work: Path,
               prompts_file: Path, vllm_model: Path | None) -> dict:
    python = VLLM_PYTHON if system == "vllm" else Path(sys.executable)
    command = [str(python), __file__, "--worker", "--system", system, "--dtype", args.dtype,
               "--prompts-file", str(prompts_file)]
    gguf = model_file(model)
    if gguf:
        command += ["--model-file", gguf]
    if vllm_model:
        command += ["--vllm-model", str(vllm_model)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600,
                          cwd=work)
    if done.returncode != 0:
        raise SystemExit(f"{system} on {model} failed:\n{done.stderr[-4000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith(RESULT))
    result = json.loads(line[len(RESULT):])
    result["seconds"] = {int(n): s for n, s in result["seconds"].items()}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,qwen-coder-1.5b")
    flags.add_dtype(parser)
    parser.add_argument("--lengths", default="128,256,512,1024,2000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    flags.add_out(parser, "bench/results/prefill.jsonl")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--system", "--prompts-file", "--model-file", "--vllm-model"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}: {', '.join(SYSTEMS)}")
    if "vllm" in systems and not VLLM_PYTHON.is_file():
        raise SystemExit("vllm needs .venv-vllm (bash scripts/setup_vllm.sh), or leave it out "
                         "of --systems")
    lengths = [int(n) for n in args.lengths.split(",")]
    if min(lengths) < 1:
        raise SystemExit("--lengths: positive token counts")
    from sssd.vllm.export_model import export_model

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="prefill-") as folder:
        work = Path(folder)
        prompts_file = work / "prompts.json"
        prompts_file.write_text(json.dumps(prompts(lengths, args.repeats)))
        for model in args.models.split(","):
            gguf = model_file(model)
            vllm_model = export_model(work / f"model-{model}", gguf) if "vllm" in systems \
                else None
            rounds: dict[str, list[dict]] = {}
            for index in range(args.rounds):
                for system in systems:
                    print(f"{model}: round {index + 1}/{args.rounds}, {system}", file=sys.stderr,
                          flush=True)
                    rounds.setdefault(system, []).append(
                        run_system(args, system, model, work, prompts_file, vllm_model))
            for length in lengths:
                medians = {s: statistics.median(r["seconds"][length] for r in rounds[s])
                           for s in systems}
                for system in systems:
                    row = {"model": model, "dtype": args.dtype, "length": length,
                           "system": system, "ms": round(1e3 * medians[system], 1),
                           "tokens_per_s": round(length / medians[system], 1),
                           "rounds_ms": [round(1e3 * r["seconds"][length], 1)
                                         for r in rounds[system]],
                           "cpu": cpu_name()}
                    if system != "vllm":  # which attention the engine's prompts ran
                        row["attention"] = rounds[system][0]["attention"]
                    if "vllm" in medians:
                        row["speed_vs_vllm"] = round(medians["vllm"] / medians[system], 2)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
