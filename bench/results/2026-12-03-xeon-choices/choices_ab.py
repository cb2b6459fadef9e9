"""n choices of one long prompt, the way the HTTP API adds them (n requests at once, seeds
seed..seed+n-1): the scheduler as committed, where the later choices wait for the first one's
blocks and take them from the prefix cache, against the scheduler before f1ed128, where all n
prefill the prompt side by side (the same engine code with the wait turned off). Two engines
in this process, one per arm, taking turns on each prompt; a prompt is used once per arm, so
no round finds an earlier round's blocks. Prints a JSON line per (round, arm)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.long_context import code_edit_prompts  # noqa: E402


def build(loaded, dtype: str, share: bool):
    from sssd.verifier.engine import EngineConfig
    from sssd.verifier.factory import build_engine

    engine = build_engine(EngineConfig(mode="prompt_lookup", dtype=dtype, max_len=8192,
                                       reuse_acceptance=False), loaded)
    if not share:  # the scheduler before f1ed128: nobody waits for another's blocks
        engine.scheduler._awaits_shared_blocks = lambda seq: False
    return engine


def run(engine, ids, n: int, max_tokens: int, seed: int) -> dict:
    from sssd.verifier.engine.request import GenerateRequest, SamplingParams

    computed = engine.stats.num_prefill_tokens
    start = time.perf_counter()
    seqs = [engine.add_request(GenerateRequest(tuple(ids), max_tokens, SamplingParams(
        temperature=0.8, top_p=0.95, seed=seed + i))) for i in range(n)]
    first_token_s = None
    while engine.has_work():
        engine.step()
        if first_token_s is None and all(seq.output_ids for seq in seqs):
            first_token_s = time.perf_counter() - start
    seconds = time.perf_counter() - start
    return {"prompt_tokens": len(ids),
            "prompt_tokens_computed": engine.stats.num_prefill_tokens - computed,
            "cached_tokens": [seq.num_cached_tokens for seq in seqs],
            "all_first_tokens_s": round(first_token_s, 3), "seconds": round(seconds, 3),
            "output_tokens": sum(len(seq.output_ids) for seq in seqs),
            "outputs": [seq.output_ids for seq in seqs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--low", type=int, default=1800)
    parser.add_argument("--high", type=int, default=2600)
    args = parser.parse_args()
    import torch

    from sssd.common.model.loader import load_causal_lm

    loaded = load_causal_lm(None, args.dtype)
    prompts = code_edit_prompts(loaded.tokenizer, args.rounds, args.low, args.high)
    engines = {"shared": build(loaded, args.dtype, True),
               "concurrent": build(loaded, args.dtype, False)}
    for index, prompt in enumerate(prompts):
        order = ["shared", "concurrent"] if index % 2 == 0 else ["concurrent", "shared"]
        results = {}
        for arm in order:
            results[arm] = run(engines[arm], prompt["ids"], args.n, args.max_tokens,
                               seed=1000 + index)
        same = results["shared"]["outputs"] == results["concurrent"]["outputs"]
        for arm in order:
            row = {k: v for k, v in results[arm].items() if k != "outputs"}
            print(json.dumps({"round": index + 1, "arm": arm, "file": prompt["file"],
                              "n": args.n, "max_tokens": args.max_tokens, "dtype": args.dtype,
                              "threads": torch.get_num_threads(),
                              "outputs_equal_across_arms": same, **row}), flush=True)


if __name__ == "__main__":
    main()
