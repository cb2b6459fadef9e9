"""The measured budget policy against every fixed budget, by replay, without the machine's noise.

On a shared 2-core machine two runs of the same configuration a few minutes apart differ by
5-10 % in step time, more than the few percent that separate the measured policy from the best
fixed budget, so `bench/e2e.py` cannot tell whether the policy is within 5 % of the best budget.
This replays the model's greedy answers at b = 1 instead (as bench/draft_quality.py does: a
draft token is accepted exactly when it is the next answer token) and drives the real
`MeasuredBudget` the way the engine does: each step it asks for a budget, drafts (one drafter
call; trees are best-first, so the tree of budget s is the first s nodes of the largest), reports
the accepted path cut at that budget with the step's time, and on its hindsight steps scores
the larger tree `--hindsight-delay` steps later, as the engine learns it once the following
tokens are out. A step's time is the budget's cost from `--costs` (milliseconds a step, what
`bench/e2e.py` measured as `verify_ms_by_budget` at fixed budgets) times a seeded uniform
factor of 1 +- `--noise` (and, with `--drift`, times a pace that swings slowly, as a shared
machine's does between quiet and busy spells); the policy starts from `--profile` (a forward
profile file, its b = 1 row; default: the costs themselves), so a profile that was wrong (taken
under load) can be replayed too. Every fixed budget meets the same answers, the same drafter
and the same noise.

    .venv/bin/python bench/policy_replay.py --model qwen-coder-1.5b \\
        --datastore var/demo-datastore/sharegpt-12000-<fingerprint> --sets code,mt_bench \\
        --costs 1:142,2:145,4:150,8:153,16:161,32:209 --seeds 4

Prints one JSON object per (set, seed): tokens/s of every fixed budget and of the measured
policy, the policy's over the best fixed budget's (`ratio`) and the policy's budgets by steps;
then one per set with the median ratio over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from bench import flags
from bench.draft_quality import accepted_path, add_answer_arguments, references
from sssd.verifier.engine.acceptance_estimates import DEFAULT_ACCEPTANCE_PRIOR
from sssd.verifier.engine.budget_policy import (
    HINDSIGHT_EVERY,
    TIE_TOLERANCE,
    FixedBudget,
    MeasuredBudget,
)
from sssd.verifier.engine.forward_profile import DEFAULT_BUDGETS, ForwardProfile


def serve(drafter, pairs: list[tuple[list[int], list[int]]], policy, costs: dict[int, float],
          seed: int, noise: float, hindsight_delay: int, drift: float = 0.0,
          drift_period_s: float = 60.0) -> tuple[float, dict[int, int]]:
    """Tokens per second of `policy` answering the prompts one after another at b = 1, and its
    budgets by steps. With `drift`, the machine's pace swings by 1 +- drift, a sine of period
    `drift_period_s` (replayed seconds, phase by seed), as a shared machine's does."""
    from sssd.common.drafting.proposer import DraftRequest

    rng = np.random.default_rng(seed)
    phase = 2.0 * np.pi * np.random.default_rng(1000 + seed).uniform()
    largest = max(costs)
    tokens, seconds, counts = 0, 0.0, {}
    for i, (prompt, answer) in enumerate(pairs):
        key = f"q{i}"
        new, position, started = list(prompt) + answer[:1], 1, False
        pending: list[tuple[int, list[int]]] = []  # hindsight trees not scored yet
        while position < len(answer):
            budget = policy.budget(1, [key])
            drafted = policy.draft_budget(1, budget)
            tree = drafter.propose([DraftRequest(key, new, largest, is_start=not started)])[0]
            started = True
            path = accepted_path(tree, answer, position, budget)
            pace = 1.0 + drift * np.sin(2.0 * np.pi * seconds / drift_period_s + phase)
            step_s = costs[budget] * pace * rng.uniform(1.0 - noise, 1.0 + noise) / 1e3
            policy.observe(1, budget, [path], None if drafted > budget else step_s, [key])
            if drafted > budget:
                pending.append((budget, accepted_path(tree, answer, position, drafted)))
            emitted = answer[position: position + len(path) + 1]
            tokens += len(emitted)
            seconds += step_s
            counts[budget] = counts.get(budget, 0) + 1
            new, position = emitted, position + len(emitted)
            while pending and (len(pending) > hindsight_delay or position >= len(answer)):
                verified, full = pending.pop(0)
                policy.observe_hindsight(1, verified, [full], [key])
        drafter.end([key])
    return tokens / seconds, dict(sorted(counts.items()))


def parse_costs(text: str) -> dict[int, float]:
    """'1:142,2:145,...' -> {1: 142.0, 2: 145.0, ...} (milliseconds a step at each budget)."""
    try:
        costs = {int(b): float(ms) for b, ms in (item.split(":") for item in text.split(","))}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--costs {text!r}: expected budget:ms,...") from exc
    if sorted(costs) != sorted(DEFAULT_BUDGETS) or min(costs.values()) <= 0:
        raise argparse.ArgumentTypeError(
            f"--costs needs a positive cost for each of the budgets {list(DEFAULT_BUDGETS)}")
    return costs


def profile_row(path: Path | None, costs: dict[int, float]) -> ForwardProfile:
    """The b = 1 row of the profile file at `path` (None: the costs), as a b = 1 profile."""
    budgets = sorted(costs)
    if path is None:
        return ForwardProfile([1], budgets, np.array([[costs[s] / 1e3 for s in budgets]]))
    raw = json.loads(path.read_text())
    if 1 not in raw["batches"] or sorted(raw["budgets"]) != budgets:
        raise SystemExit(f"{path}: no b = 1 row over the budgets {budgets}")
    row = np.asarray(raw["seconds"])[raw["batches"].index(1)]
    return ForwardProfile([1], raw["budgets"], row[None, :])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_answer_arguments(parser, "code,mt_bench", 24)
    flags.add_datastore(parser, "built with the model's tokenizer (default: the ShareGPT "
                        "datastore the main job builds)")
    parser.add_argument("--costs", type=parse_costs, required=True,
                        help="ms a step at budgets 1,2,4,8,16,32, as budget:ms,...")
    parser.add_argument("--profile", type=Path, default=None,
                        help="the policy's forward profile (a profile file; default: the costs)")
    parser.add_argument("--seeds", type=int, default=4, help="noise seeds (4)")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="a step's time is its cost times 1 +- this, uniform (0.05)")
    parser.add_argument("--drift", type=float, default=0.0,
                        help="the pace swings by 1 +- this over --drift-period (0: steady)")
    parser.add_argument("--drift-period", type=float, default=60.0,
                        help="seconds of replayed time a swing of the pace takes (60)")
    parser.add_argument("--hindsight-delay", type=int, default=1,
                        help="steps before a hindsight tree is scored (1)")
    parser.add_argument("--tie-tolerance", type=float, default=TIE_TOLERANCE,
                        help=f"the policy's tie tolerance ({TIE_TOLERANCE}, the engine's)")
    parser.add_argument("--hindsight-every", type=int, default=HINDSIGHT_EVERY,
                        help="every this many-th drafter call drafts the largest tree "
                        f"({HINDSIGHT_EVERY}, the engine's; 0: never)")
    args = parser.parse_args(argv)

    from sssd.cli.datastores import pick_datastore
    from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter

    tokenizer = load_tokenizer(args.model)
    datastore = pick_datastore(args.datastore, tokenizer)
    config = DrafterConfig(datastore_dir=str(datastore), vocab_size=vocab_size(tokenizer),
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    with LocalDrafter(config) as drafter:
        for set_name in args.sets.split(","):
            pairs = references(set_name, args.prompts, args.max_tokens, args.dtype,
                               args.batch_size, args.model)
            ratios = []
            for seed in range(args.seeds):
                machine = (args.costs, seed, args.noise, args.hindsight_delay, args.drift,
                           args.drift_period)  # every configuration meets the same one
                fixed = {s: serve(drafter, pairs, FixedBudget(s), *machine)[0]
                         for s in sorted(args.costs)}
                policy = MeasuredBudget(profile_row(args.profile, args.costs), max(args.costs),
                                        prior=DEFAULT_ACCEPTANCE_PRIOR,
                                        tie_tolerance=args.tie_tolerance,
                                        hindsight_every=args.hindsight_every)
                rate, counts = serve(drafter, pairs, policy, *machine)
                best = max(fixed, key=fixed.get)
                ratios.append(rate / fixed[best])
                print(json.dumps({"set": set_name, "seed": seed, "datastore": str(datastore),
                                  "fixed_tok_s": {s: round(r, 3) for s, r in fixed.items()},
                                  "measured_tok_s": round(rate, 3), "best_fixed": best,
                                  "ratio": round(ratios[-1], 4), "budget_counts": counts,
                                  "tie_tolerance": policy.tie_tolerance,
                                  "hindsight_every": policy.hindsight_every,
                                  "drift": args.drift}),
                      flush=True)
            print(json.dumps({"set": set_name, "num_prompts": len(pairs), "seeds": args.seeds,
                              "median_ratio": round(statistics.median(ratios), 4),
                              "min_ratio": round(min(ratios), 4)}), flush=True)


if __name__ == "__main__":
    main()
