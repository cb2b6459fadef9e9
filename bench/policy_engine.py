"""The measured budget policy in the real engine, each step priced from a cost table.

`bench/e2e.py` times the policy against fixed budgets on the machine, where a few percent of
noise between configurations hides the few percent that separate them; `bench/policy_replay.py`
removes the noise but replays the model's answers at b = 1 outside the engine. This runs the
real engine (the model's forward pass, its drafter, hindsight, continuous batching at
`--batch-size`) for every configuration, side by side chunk by chunk, and prices each step at
its budget's cost from `--costs` (the milliseconds a step took at each fixed budget in
`bench/e2e.py`; steps with fewer rows than `--drain-rows`, as a chunk drains, at
`--drain-costs`). The measured policy is told those costs as its steps' times, so two policy
variants meet the same answers, the same drafts and the same prices: what differs is only the
budgets they choose. Variants: `--row-decays` (how fast a sequence's own acceptance estimate
follows its steps, MeasuredBudget's `row_decay`).

    .venv/bin/python bench/policy_engine.py --sets code,mt_bench --prompts 16 --batch-size 1 \\
        --costs 1:18.3,2:20.6,4:21.1,8:22.2,16:24.1,32:31.5 --fixed 8,16 --row-decays 0.1,0.05 \\
        --orders 3

Prints one JSON object per (set, order, configuration): priced tokens/s, its ratio to the best
fixed budget's, tokens per step and budgets by steps; with `--orders` above 1, then one per
(set, configuration) with the median and lowest ratio over the orders.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import Run  # noqa: E402
from policy_replay import parse_costs  # noqa: E402
from prompt_sets import SETS, prompt_texts  # noqa: E402

from sssd.cli.datastores import check_datastore, pick_datastore  # noqa: E402
from sssd.common.config.logs import configure_logging  # noqa: E402
from sssd.common.data.corpus import prompt_token_ids  # noqa: E402
from sssd.common.model.loader import load_causal_lm  # noqa: E402
from sssd.verifier.engine.budget_policy import ROW_DECAY  # noqa: E402


class PricedRun:
    """One configuration's engine, whose steps are priced from the tables instead of timed."""

    def __init__(self, run: Run, costs: dict[int, float], drain_costs: dict[int, float],
                 drain_rows: int) -> None:
        self.run = run
        self.costs, self.drain_costs = costs, drain_costs
        self.steps: Counter[tuple[bool, int]] = Counter()  # (drained, budget) -> steps
        policy = run.engine.budget_policy
        observe = policy.observe

        def priced(batch_size, budget, accepted_nodes, step_s, rows=None):
            drained = batch_size < drain_rows
            self.steps[(drained, budget)] += 1
            if step_s is not None:  # a timed step: the policy is told its price instead
                step_s = self.price(drained, budget)
            observe(batch_size, budget, accepted_nodes, step_s, rows)

        policy.observe = priced

    def price(self, drained: bool, budget: int) -> float:
        """Seconds a step at `budget` costs, at the full batch or (`drained`) the drain's."""
        return (self.drain_costs if drained else self.costs)[budget] / 1e3

    def priced_seconds(self) -> float:
        return sum(self.price(*step) * n for step, n in self.steps.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a name of `sssd-models list` (SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--datastore", type=Path, default=None,
                        help="built with the model's tokenizer (default: the ShareGPT datastore "
                        "the main job builds)")
    parser.add_argument("--sets", default="code,mt_bench", help=f"comma-separated of {SETS}")
    parser.add_argument("--prompts", type=int, default=16, help="per set (16)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=2,
                        help="configurations take turns chunk by chunk (2)")
    parser.add_argument("--orders", type=int, default=1,
                        help="runs over this many orders of the prompts (the first as given, "
                        "then seeded shuffles): a policy's path depends on the order its "
                        "sequences come in, and one order's ratio swings by a few points (1)")
    parser.add_argument("--costs", type=parse_costs, required=True,
                        help="ms a step at budgets 1,2,4,8,16,32 at the full batch, budget:ms,...")
    parser.add_argument("--drain-costs", type=parse_costs, default=None,
                        help="the same for steps with fewer than --drain-rows rows (default: "
                        "--costs)")
    parser.add_argument("--drain-rows", type=int, default=1,
                        help="steps with fewer rows are priced at --drain-costs (1: none)")
    parser.add_argument("--fixed", default="8,16", help="fixed budgets to compare (8,16)")
    parser.add_argument("--row-decays", default=str(ROW_DECAY),
                        help=f"measured policy variants by row_decay ({ROW_DECAY})")
    parser.add_argument("--profile", type=Path, default=Path("var/forward-profile.json"),
                        help="the measured policy's forward profile (measured when missing)")
    args = parser.parse_args(argv)
    if not [s for s in args.fixed.split(",") if s]:
        raise SystemExit("--fixed needs at least one budget: the ratios are to the best of them")
    configure_logging()

    loaded = load_causal_lm(args.model, args.dtype, "cpu")
    datastore = pick_datastore(args.datastore, loaded.tokenizer)
    try:
        check_datastore(datastore, loaded.fingerprint)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    drain_costs = args.drain_costs or args.costs
    configs = [(f"fixed:{s}", f"fixed:{s}", None) for s in args.fixed.split(",") if s] + \
        [(f"measured:row_decay={d}", "measured", float(d)) for d in args.row_decays.split(",")]
    for set_name in args.sets.split(","):
        given = [prompt_token_ids(loaded.tokenizer, text)
                 for text in prompt_texts(set_name, args.prompts)]
        max_len = max(len(p) for p in given) + args.max_tokens + 64
        ratios: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        for order in range(args.orders):
            prompts = given if order == 0 else \
                [given[i] for i in np.random.default_rng(order).permutation(len(given))]
            for name, ratio in run_order(args, loaded, datastore, configs, drain_costs, prompts,
                                         max_len, set_name, order).items():
                ratios[name].append(ratio)
        if args.orders > 1:
            for name, values in ratios.items():
                print(json.dumps({"set": set_name, "config": name, "batch": args.batch_size,
                                  "orders": args.orders,
                                  "median_ratio": round(statistics.median(values), 4),
                                  "min_ratio": round(min(values), 4)}), flush=True)


def run_order(args: argparse.Namespace, loaded, datastore: Path, configs: list,
              drain_costs: dict[int, float], prompts: list[list[int]], max_len: int,
              set_name: str, order: int) -> dict[str, float]:
    """Every configuration over the prompts in this order; prints their rows and returns each
    one's priced rate over the best fixed budget's."""
    runs = {}
    for name, policy, row_decay in configs:
        run = Run(loaded, "sssd", args.batch_size, policy, max_len, None, datastore,
                  args.profile, prompts[: args.batch_size])
        if row_decay is not None:  # after the engine's warm-up (8 tokens), run at the default
            run.engine.budget_policy.row_decay = row_decay
        runs[name] = PricedRun(run, args.costs, drain_costs, args.drain_rows)
    num_chunks = max(1, min(args.chunks, len(prompts) // args.batch_size))
    for chunk in (prompts[i::num_chunks] for i in range(num_chunks)):
        for priced in runs.values():
            priced.run.run_chunk(chunk, args.max_tokens)
    first_outputs = next(iter(runs.values())).run.outputs
    rates = {}
    for name, priced in runs.items():
        # The first token of each answer comes from its prompt's pass, not a priced step.
        tokens = sum(len(o) - 1 for o in priced.run.outputs if o)
        rates[name] = tokens / priced.priced_seconds()
    best = max((name for name in rates if name.startswith("fixed:")), key=rates.get)
    ratios = {}
    for name, priced in runs.items():
        row = priced.run.row()
        ratios[name] = rates[name] / rates[best]
        budgets = Counter()
        for (_, budget), n in priced.steps.items():
            budgets[budget] += n
        print(json.dumps({
            "set": set_name, "config": name, "batch": args.batch_size, "order": order,
            "priced_tok_s": round(rates[name], 3),
            "ratio_to_best_fixed": round(ratios[name], 4),
            "best_fixed": best, "tokens_per_step": round(row["tokens_per_step"], 3),
            "budget_counts": {str(k): v for k, v in sorted(budgets.items())},
            "same_as_first": sum(a == b for a, b in zip(priced.run.outputs, first_outputs)),
            "num_prompts": len(prompts), "max_tokens": args.max_tokens,
            "model": args.model or "SmolLM2-135M-Instruct", "datastore": str(datastore),
        }), flush=True)
        priced.run.close()
    return ratios


if __name__ == "__main__":
    main()
