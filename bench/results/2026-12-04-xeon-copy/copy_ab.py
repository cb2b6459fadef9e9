"""Whole-file code edits (bench/long_context.py's set) decoded by the engine in this process
without speculation, with prompt lookup and with SSSD, each drafter without its copy source
(SSSD_DRAFTER_COPY_MIN_MATCH=0: the trees before it) and with it (the defaults): five engines on
one loaded model, taking turns file by file in a rotating order, so the machine's noise falls on
every arm alike. Each engine computes a file's prompt once (one token, untimed), then decodes
the answer from its prefix cache, timed. Prints a JSON line per (file, arm), then one summary
line per arm (medians over the files)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.long_context import code_edit_prompts  # noqa: E402

ARMS = {  # arm: (mode, copy source on)
    "ar": ("ar", False),
    "prompt_lookup-paper": ("prompt_lookup", False),
    "prompt_lookup-copy": ("prompt_lookup", True),
    "sssd-paper": ("sssd", False),
    "sssd-copy": ("sssd", True),
}


def build(loaded, args, mode: str, copy: bool):
    from sssd.verifier.engine import EngineConfig
    from sssd.verifier.factory import build_engine

    # In-process drafting reads the drafter's constants from the environment when it is built.
    if not copy:
        os.environ["SSSD_DRAFTER_COPY_MIN_MATCH"] = "0"
    try:
        return build_engine(EngineConfig(
            mode=mode, dtype=args.dtype, max_len=8192, kv_cache_memory=args.kv_cache_memory,
            datastore_dir=args.datastore if mode == "sssd" else None,
            budget_policy=args.budget_policy, reuse_acceptance=False), loaded)
    finally:
        os.environ.pop("SSSD_DRAFTER_COPY_MIN_MATCH", None)


def decode(engine, ids: list[int], max_tokens: int) -> dict:
    from sssd.verifier.engine.request import GenerateRequest

    engine.add_request(GenerateRequest(tuple(ids), 1))  # the prompt, into the prefix cache
    while engine.has_work():
        engine.step()
    start = time.perf_counter()
    seq = engine.add_request(GenerateRequest(tuple(ids), max_tokens))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    return {"tokens": len(seq.output_ids), "steps": steps, "seconds": round(seconds, 3),
            "tok_s": len(seq.output_ids) / seconds, "output": seq.output_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 or a name of `sssd-models list`")
    parser.add_argument("--datastore", default=None,
                        help="default: the ShareGPT datastore `sssd up` builds for the model's "
                        "tokenizer")
    parser.add_argument("--budget-policy", default="measured")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    args = parser.parse_args()

    from bench.engine_speed import model_file
    from sssd.cli.datastores import pick_datastore
    from sssd.common.model.loader import load_causal_lm

    loaded = load_causal_lm(model_file(args.model), args.dtype)
    args.datastore = args.datastore or str(pick_datastore(None, loaded.tokenizer))
    prompts = code_edit_prompts(loaded.tokenizer, args.files)
    engines = {arm: build(loaded, args, mode, copy) for arm, (mode, copy) in ARMS.items()}
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    names = list(ARMS)
    for index, prompt in enumerate(prompts):
        order = names[index % len(names):] + names[:index % len(names)]
        results = {arm: decode(engines[arm], prompt["ids"], args.max_tokens) for arm in order}
        reference = results["ar"]
        for arm in names:
            result = results[arm]
            row = {"file": prompt["file"], "prompt": len(prompt["ids"]), "arm": arm,
                   **{k: v for k, v in result.items() if k != "output"},
                   "tokens_per_step": result["tokens"] / result["steps"],
                   "speedup": result["tok_s"] / reference["tok_s"],
                   "same_as_ar": result["output"] == reference["output"]}
            rows[arm].append(row)
            print(json.dumps(row), flush=True)
    for arm in names:
        print(json.dumps({
            "summary": arm, "files": len(rows[arm]),
            "median_tok_s": statistics.median(r["tok_s"] for r in rows[arm]),
            "median_speedup": statistics.median(r["speedup"] for r in rows[arm]),
            "median_tokens_per_step": statistics.median(r["tokens_per_step"] for r in rows[arm]),
            "tokens_per_step": sum(r["tokens"] for r in rows[arm]) /
            sum(r["steps"] for r in rows[arm]),
            "same_as_ar": sum(r["same_as_ar"] for r in rows[arm])}), flush=True)


if __name__ == "__main__":
    main()
