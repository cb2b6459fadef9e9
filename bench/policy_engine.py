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
follows its steps, MeasuredBudget's `row_decay`). The measured policy starts afresh after the
engine's warm-up, so that it learns from priced steps only and a run repeats to the last digit.

A cost table has no noise, and a real machine's step times scatter about their medians, with a
slow tail. `--record-steps FILE` writes the real seconds of every timed step, by configuration
and budget; `--step-noise FILE` reads such a file and adds to each priced step one of its
steps' excess over their budget's median (drawn with a seed per order, the same draws for every
configuration), so that the policy's estimates of step cost meet the machine's scatter, and the
same scatter in every variant and every run. A machine's excess comes in spells (the excesses of
consecutive steps correlate by 0.2-0.3 on the 2-core Xeon): `--noise-block K` draws runs of
K consecutive recorded steps instead of single ones.

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
from collections import Counter
from pathlib import Path

import numpy as np

from bench import flags
from bench.e2e import Run
from bench.policy_replay import parse_costs
from bench.prompt_sets import prompt_texts
from sssd.cli.datastores import check_datastore, pick_datastore
from sssd.common.config.logs import configure_logging
from sssd.common.data.corpus import prompt_token_ids
from sssd.common.model.loader import load_causal_lm
from sssd.verifier.engine.acceptance_estimates import DEFAULT_ACCEPTANCE_PRIOR, ROW_DECAY
from sssd.verifier.engine.budget_policy import MeasuredBudget


class PricedRun:
    """One configuration's engine, whose steps are priced from the tables instead of timed."""

    def __init__(self, run: Run, costs: dict[int, float], drain_costs: dict[int, float],
                 drain_rows: int, noise_ms: list[np.ndarray] | None = None, seed: int = 0,
                 noise_block: int = 1) -> None:
        """`noise_ms`: sequences of excess milliseconds over the table; each step adds the next
        of a run of `noise_block` consecutive ones, runs drawn (seeded) anywhere in them."""
        self.run = run
        self.costs, self.drain_costs = costs, drain_costs
        self.noise_ms, self.noise_block = noise_ms, noise_block
        self._rng = np.random.default_rng(seed)
        self._pending: list[float] = []  # the rest of the current run of draws, last first
        self._num_noise = sum(len(sequence) for sequence in noise_ms or ())
        self.steps: Counter[int] = Counter()  # budget -> steps
        self.seconds = 0.0  # the priced steps' total
        self.real_seconds: dict[int, list[float]] = {}  # budget -> real seconds of timed steps
        policy = run.engine.budget_policy
        observe = policy.observe

        def priced(batch_size, budget, accepted_nodes, step_s, rows=None):
            self.steps[budget] += 1
            price = self.price(batch_size < drain_rows, budget)
            self.seconds += price
            if step_s is not None:  # a timed step: the policy is told its price instead
                self.real_seconds.setdefault(budget, []).append(step_s)
                step_s = price
            observe(batch_size, budget, accepted_nodes, step_s, rows)

        policy.observe = priced

    def price(self, drained: bool, budget: int) -> float:
        """Seconds a step at `budget` costs, at the full batch or (`drained`) the drain's, plus
        a draw of the noise if any (never below half the table's)."""
        table = (self.drain_costs if drained else self.costs)[budget]
        if self.noise_ms is None:
            return table / 1e3
        return max(0.5 * table, table + self._next_noise()) / 1e3

    def _next_noise(self) -> float:
        if not self._pending:  # a run starting at any recorded step, all equally likely
            at = int(self._rng.integers(self._num_noise))
            for sequence in self.noise_ms:
                if at < len(sequence):
                    break
                at -= len(sequence)
            self._pending = [float(x) for x in sequence[at: at + self.noise_block][::-1]]
        return self._pending.pop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_model(parser)
    flags.add_dtype(parser)
    flags.add_datastore(parser, "built with the model's tokenizer (default: the ShareGPT "
                        "datastore the main job builds)")
    flags.add_sets(parser, "code,mt_bench")
    flags.add_prompts(parser, 16, per_set=True)
    flags.add_max_tokens(parser, 128)
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
    parser.add_argument("--step-noise", type=Path, default=None,
                        help="a --record-steps file: each priced step gets one of its steps' "
                        "excess over their budget's median added")
    parser.add_argument("--noise-block", type=int, default=1,
                        help="draw the noise in runs of this many consecutive recorded steps "
                        "(1: each step alone)")
    parser.add_argument("--record-steps", type=Path, default=None,
                        help="write the real seconds of every timed step here (JSON, by set, "
                        "order, configuration and budget)")
    parser.add_argument("--profile", type=Path, default=Path("var/forward-profile.json"),
                        help="the measured policy's forward profile (measured when missing)")
    args = parser.parse_args(argv)
    if args.noise_block < 1:
        raise SystemExit("--noise-block must be at least 1")
    if not [s for s in args.fixed.split(",") if s]:
        raise SystemExit("--fixed needs at least one budget: the ratios are to the best of them")
    configure_logging()

    loaded = load_causal_lm(args.model, args.dtype, "cpu")
    datastore = pick_datastore(args.datastore, loaded.tokenizer)
    try:
        check_datastore(datastore, loaded.fingerprint)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    noise_ms = None if args.step_noise is None else step_noise(args.step_noise)
    drain_costs = args.drain_costs or args.costs
    configs = [(f"fixed:{s}", f"fixed:{s}", None) for s in args.fixed.split(",") if s] + \
        [(f"measured:row_decay={d}", "measured", float(d)) for d in args.row_decays.split(",")]
    recorded: dict = {}
    for set_name in args.sets.split(","):
        given = [prompt_token_ids(loaded.tokenizer, text)
                 for text in prompt_texts(set_name, args.prompts)]
        max_len = max(len(p) for p in given) + args.max_tokens + 64
        ratios: dict[str, list[float]] = {name: [] for name, _, _ in configs}
        for order in range(args.orders):
            prompts = given if order == 0 else \
                [given[i] for i in np.random.default_rng(order).permutation(len(given))]
            for name, ratio in run_order(args, loaded, datastore, configs, drain_costs, prompts,
                                         max_len, set_name, order, noise_ms,
                                         recorded.setdefault(f"{set_name}/{order}", {})).items():
                ratios[name].append(ratio)
            if args.record_steps is not None:  # after every order: a long run keeps its part
                args.record_steps.write_text(json.dumps(recorded))
        if args.orders > 1:
            for name, values in ratios.items():
                print(json.dumps({"set": set_name, "config": name, "batch": args.batch_size,
                                  "orders": args.orders,
                                  "median_ratio": round(statistics.median(values), 4),
                                  "min_ratio": round(min(values), 4)}), flush=True)


def run_order(args: argparse.Namespace, loaded, datastore: Path, configs: list,
              drain_costs: dict[int, float], prompts: list[list[int]], max_len: int,
              set_name: str, order: int, noise_ms: list[np.ndarray] | None,
              recorded: dict) -> dict[str, float]:
    """Every configuration over the prompts in this order; prints their rows, puts the real
    seconds of their timed steps in `recorded` (configuration -> budget -> seconds) and
    returns each one's priced rate over the best fixed budget's."""
    runs = {}
    for name, policy, row_decay in configs:
        run = Run(loaded, "sssd", args.batch_size, policy, max_len, None, datastore,
                  args.profile, prompts[: args.batch_size])
        run.engine.budget_policy = after_warm_up(run.engine.budget_policy, row_decay)
        runs[name] = PricedRun(run, args.costs, drain_costs, args.drain_rows, noise_ms,
                               seed=order, noise_block=args.noise_block)
    num_chunks = max(1, min(args.chunks, len(prompts) // args.batch_size))
    for chunk in (prompts[i::num_chunks] for i in range(num_chunks)):
        for priced in runs.values():
            priced.run.run_chunk(chunk, args.max_tokens)
    first_outputs = next(iter(runs.values())).run.outputs
    rates = {}
    for name, priced in runs.items():
        # The first token of each answer comes from its prompt's pass, not a priced step.
        tokens = sum(len(o) - 1 for o in priced.run.outputs if o)
        rates[name] = tokens / priced.seconds
        recorded[name] = {str(b): v for b, v in sorted(priced.real_seconds.items())}
    best = max((name for name in rates if name.startswith("fixed:")), key=rates.get)
    ratios = {}
    for name, priced in runs.items():
        row = priced.run.row()
        ratios[name] = rates[name] / rates[best]
        print(json.dumps({
            "set": set_name, "config": name, "batch": args.batch_size, "order": order,
            "priced_tok_s": round(rates[name], 3),
            "ratio_to_best_fixed": round(ratios[name], 4),
            "best_fixed": best, "tokens_per_step": round(row["tokens_per_step"], 3),
            "budget_counts": {str(k): v for k, v in sorted(priced.steps.items())},
            "same_as_first": sum(a == b for a, b in zip(priced.run.outputs, first_outputs)),
            "num_prompts": len(prompts), "max_tokens": args.max_tokens,
            "model": args.model or "SmolLM2-135M-Instruct", "datastore": str(datastore),
        }), flush=True)
        priced.run.close()
    return ratios


def after_warm_up(policy, row_decay: float | None):
    """The policy to price steps with once the engine has warmed up: a measured one afresh, as
    the engine builds it (at `row_decay`), a fixed one as it is. The warm-up (8 tokens) ran the
    measured policy on real step times, which its estimates would keep (a budget timed there
    and seldom run again keeps its real-time estimate for good): every run then differed, by up
    to 2.5 points of the ratio."""
    if not isinstance(policy, MeasuredBudget):
        return policy
    return MeasuredBudget(policy.profile, policy.candidates[-1][1],
                          prior=DEFAULT_ACCEPTANCE_PRIOR, row_decay=row_decay)


def step_noise(path: Path, min_steps: int = 20) -> list[np.ndarray]:
    """Milliseconds each recorded step took beyond the median of its (set, order,
    configuration, budget), in the order they ran, for those with at least `min_steps`
    steps."""
    try:
        recorded = json.loads(path.read_text())
        excess = [1e3 * (np.asarray(seconds, dtype=np.float64) - np.median(seconds))
                  for configs in recorded.values() for budgets in configs.values()
                  for seconds in budgets.values() if len(seconds) >= min_steps]
    except (OSError, ValueError, AttributeError, TypeError) as error:
        raise SystemExit(f"--step-noise {path}: not a --record-steps file ({error})") from None
    if not excess:
        raise SystemExit(f"--step-noise {path}: no budget with {min_steps} or more steps")
    return excess


if __name__ == "__main__":
    main()
