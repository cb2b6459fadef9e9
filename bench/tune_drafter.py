"""Tunes the drafter's constants on held-out data by replay (bench/draft_quality.py).

Coordinate descent over the constants of docs/algorithm.md, scored by the mean tokens per step over
the budgets on the `sharegpt-tune` set (first turns of ShareGPT records 12,000-14,999, outside
the ShareGPT datastore, which holds records 0-11,999). MT-Bench and the code set are never
used here; score the result on them afterwards with draft_quality.py.

    python bench/tune_drafter.py --prompts 200 --budgets 4,8,16,32
    python bench/tune_drafter.py --model qwen-coder-1.5b --prompts 80 --budgets 8,16 --passes 1 \
        --datastore var/demo-datastore/sharegpt-12000-<fingerprint>

Prints one JSON object per evaluated configuration, then {"best": ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from bench import flags
from bench.draft_quality import references, replay
from sssd.common.config.logs import configure_logging

# The values tried for each constant, in the order they are swept.
GRID = {
    "input_discount": [0.3, 0.45, 0.6, 0.8, 1.0],
    "input_child_discount_base": [0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
    "input_child_discount_per_match": [0.0, 0.025, 0.05, 0.1],
    "datastore_child_discount": [0.7, 0.8, 0.9, 1.0],
    "branch_len": [6, 8, 10, 12, 16],
    "prefix_len": [3, 4, 5, 6],
    "min_continuations": [10, 25, 50, 100, 200],
    "max_continuations": [50, 100, 200, 400],
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    flags.add_prompts(parser, 200)
    flags.add_max_tokens(parser, 128)
    parser.add_argument("--budgets", default="4,8,16,32")
    parser.add_argument("--passes", type=int, default=2, help="sweeps over every constant")
    flags.add_datastore(parser, "the datastore tuned against (default: the ShareGPT datastore)")
    flags.add_model(parser)
    args = parser.parse_args(argv)
    configure_logging(logging.WARNING)

    from sssd.cli.datastores import pick_datastore
    from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
    from sssd.drafter.config import DrafterConfig, DraftParams
    from sssd.drafter.drafter import LocalDrafter

    tokenizer = load_tokenizer(args.model)
    datastore = args.datastore or pick_datastore(None, tokenizer)
    pairs = references("sharegpt-tune", args.prompts, args.max_tokens, "bfloat16", 8, args.model)
    budgets = [int(b) for b in args.budgets.split(",")]
    scores: dict[tuple, float] = {}

    def score(values: dict) -> float | None:
        key = tuple(sorted(values.items()))
        if key in scores:
            return scores[key]
        try:
            params = DraftParams(**values)
        except ValueError:
            return None  # e.g. base + per_match * prefix_len > 1
        config = DrafterConfig(datastore_dir=str(datastore), vocab_size=vocab_size(tokenizer),
                               tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
                               params=params)
        with LocalDrafter(config) as drafter:
            per_budget = {b: replay(drafter, pairs, b)["tokens_per_step"] for b in budgets}
        scores[key] = sum(per_budget.values()) / len(per_budget)
        print(json.dumps({"params": values, "tokens_per_step": per_budget,
                          "mean": scores[key]}), flush=True)
        return scores[key]

    defaults = {f.name: f.default for f in dataclasses.fields(DraftParams)}
    best = dict(defaults)
    best_score = score(best)
    for _ in range(args.passes):
        improved = False
        for name, values in GRID.items():
            for value in values:
                candidate = {**best, name: value}
                result = score(candidate)
                if result is not None and result > best_score + 1e-4:
                    best, best_score, improved = candidate, result, True
        if not improved:
            break
    changed = {k: v for k, v in best.items() if v != defaults[k]}
    print(json.dumps({"best": changed, "mean": best_score,
                      "default_mean": scores[tuple(sorted(defaults.items()))]}), flush=True)


if __name__ == "__main__":
    main()
