"""How often bfloat16 greedy answers change with the batch and the draft trees, and what making
them not change costs.

Three verification set-ups, side by side in one process on the same bf16 weights:
  sdpa_unaligned  PyTorch's fused SDPA attention, key length = the longest row (the old default)
  sdpa            SDPA, key length rounded up to 128 (tree_batch.KV_ALIGN; the default)
  eager           eager attention, key length rounded up to 128 (`--attention eager`)
For each: plain greedy decoding one prompt at a time (the reference), plain greedy at batch 4,
and SSSD (ShareGPT datastore, rule policy) at batch 4 over the same prompts; a row counts the
answers identical to the reference. Then the verification forward pass is timed at
(batch, tree size) = (1, 1), (1, 8), (1, 32), (4, 1), (4, 8): median ms of `--repeats` calls.

Prints one JSON object per set-up and per timing.

    python bench/batch_invariance.py --prompts 16 --max-tokens 64 \\
        --datastore var/demo-datastore/sharegpt-12000-<fingerprint>
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from bench import flags
from bench.prompt_sets import prompt_texts

SETUPS = {"sdpa_unaligned": ("sdpa", 1), "sdpa": ("sdpa", 128), "eager": ("eager", 128)}
TIMINGS = ((1, 1), (1, 8), (1, 32), (4, 1), (4, 8))


def engine(loaded, mode: str, batch: int, attention: str, kv_align: int, datastore: str | None,
           max_len: int):
    from sssd.verifier.engine import EngineConfig
    from sssd.verifier.factory import build_engine

    built = build_engine(EngineConfig(
        mode=mode, max_batch_size=batch, budget_policy="rule", max_len=max_len,
        attention=attention, datastore_dir=datastore if mode == "sssd" else None), loaded)
    built.runner.kv_align = kv_align
    return built


def time_verify(runner, batch: int, nodes: int, prompts: list[list[int]], repeats: int) -> float:
    from sssd.common.drafting.draft_tree import DraftTree

    for slot in range(batch):
        runner.prefill(slot, prompts[slot])
    trees = [DraftTree(np.array([11] + [100 + i for i in range(nodes - 1)], np.int32),
                       np.arange(-1, nodes - 1, dtype=np.int32)) for _ in range(batch)]
    runner.verify(trees)  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.verify(trees)
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds)


def main(argv: list[str] | None = None) -> None:
    from sssd.common.data.corpus import prompt_token_ids
    from sssd.common.model.loader import load_causal_lm

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    flags.add_set(parser, choices=("mt_bench", "code"))
    flags.add_prompts(parser, 16)
    flags.add_max_tokens(parser, 64)
    flags.add_datastore(parser, "the drafter's datastore", required=True, type=str)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    loaded = load_causal_lm(None, "bfloat16")
    prompts = [prompt_token_ids(loaded.tokenizer, text)
               for text in prompt_texts(args.set, args.prompts)]
    max_len = max(len(p) for p in prompts) + args.max_tokens + 64
    for name, (attention, kv_align) in SETUPS.items():
        answers, rates = {}, {}
        for label, mode, batch in (("plain_b1", "ar", 1), ("plain_b4", "ar", 4),
                                   ("sssd_b4", "sssd", 4)):
            built = engine(loaded, mode, batch, attention, kv_align, args.datastore, max_len)
            start = time.perf_counter()
            answers[label] = built.generate(prompts, args.max_tokens)
            rates[label] = sum(map(len, answers[label])) / (time.perf_counter() - start)
            built.close()
        reference = answers["plain_b1"]
        print(json.dumps({
            "setup": name, "attention": attention, "kv_align": kv_align,
            "prompts": len(prompts), "max_tokens": args.max_tokens,
            "identical_to_plain_b1": {label: sum(a == b for a, b in zip(out, reference))
                                      for label, out in answers.items() if label != "plain_b1"},
            "tok_s": {label: round(rate, 2) for label, rate in rates.items()}}), flush=True)
    for batch, nodes in TIMINGS:
        row = {"batch": batch, "tree_nodes": nodes}
        for name, (attention, kv_align) in SETUPS.items():
            built = engine(loaded, "ar", batch, attention, kv_align, None, max_len)
            row[f"{name}_ms"] = round(time_verify(built.runner, batch, nodes, prompts,
                                                  args.repeats), 2)
        row["eager_over_sdpa"] = round(row["eager_ms"] / row["sdpa_ms"], 3)
        row["sdpa_over_unaligned"] = round(row["sdpa_ms"] / row["sdpa_unaligned_ms"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
