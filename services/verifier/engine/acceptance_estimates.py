"""The measured budget policy's acceptance estimates: E[accepted draft tokens | s_q] for every
budget, learned online, globally and per sequence (budget_policy.MeasuredBudget prices budgets
with them).

One verified tree of budget B also tells what every smaller budget s would have accepted: the
drafter inserts nodes best-first (docs/algorithm.md, "Output"), so the tree of budget s is the
first s nodes of the tree of budget B, and the accepted path cut at its first node with index
>= s is what that tree would have kept (node indices grow along a path). So every step updates
every budget up to its own, each with a moving average of what it accepts beyond the next
smaller budget (its increment); a budget's estimate is the sum of the increments up to it.
Budgets are compared by these sums, never by estimates learned apart: a budget run less often
than a smaller one must not fall behind it for being learned from older steps (a tree holds
every smaller one, so it accepts at least as much, step by step).
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from sssd.verifier.engine.forward_profile import write_json

# Draft tokens accepted per step at each budget before the policy has seen a step of its own:
# SSSD on the ShareGPT datastore the main job builds, replaying SmolLM2-135M's greedy answers to
# MT-Bench (`bench/draft_quality.py --sets mt_bench`), rounded down.
DEFAULT_ACCEPTANCE_PRIOR = {1: 0.0, 2: 0.43, 4: 0.82, 8: 1.1, 16: 1.3, 32: 1.45}
PRIOR_WEIGHT = 8  # the prior counts as this many observed rows (one sequence's tree of a step)
# A sequence's own acceptance estimate starts from the global one, worth ROW_PRIOR_WEIGHT of its
# steps, then moves ROW_DECAY of the way to each of its own steps: a memory of about 20 steps,
# long enough that a few poor steps do not send a sequence below its best budget
# (bench/results/2026-11-30-xeon-7). At most MAX_ROWS sequences are remembered, the least
# recently seen dropped first.
ROW_PRIOR_WEIGHT = 4
ROW_DECAY = 0.05
MAX_ROWS = 1024


class AcceptanceEstimates:
    """Per budget (ascending `budgets`), the mean accepted draft tokens of a row, globally (a new
    sequence's start, what `save` keeps) and per sequence (its key). The global estimates start
    from `prior` (what an earlier run saved, or DEFAULT_ACCEPTANCE_PRIOR) worth PRIOR_WEIGHT
    rows; without a prior every budget is unobserved until a step at it or above."""

    def __init__(self, budgets: Sequence[int], decay: float = 0.05, row_decay: float = ROW_DECAY,
                 prior: dict[int, float] | None = None) -> None:
        self.budgets = sorted(budgets)
        self.decay = decay
        self.row_decay = row_decay
        # What each budget accepts beyond the next smaller one, per row; None until observed.
        self._increments: dict[int, float | None] = {s: None for s in self.budgets}
        self._weights = {s: 0 for s in self.budgets}  # rows behind each estimate
        # The next smaller budget's (1 below the smallest: the root, never a draft).
        self._below = {s: max((t for t in self.budgets if t < s), default=1)
                       for s in self.budgets}
        if prior is not None:
            below = 0.0
            for s in self.budgets:
                if s not in prior:
                    break
                self._increments[s] = max(0.0, float(prior[s]) - below)
                self._weights[s] = PRIOR_WEIGHT
                below = max(below, float(prior[s]))
        # Per sequence (its key), its own increment per budget and the steps behind each.
        self._rows: OrderedDict[Hashable, tuple[dict[int, float], dict[int, int]]] = \
            OrderedDict()

    @property
    def expected(self) -> dict[int, float | None]:
        """Mean accepted draft tokens per row at each budget (None from the first budget not
        yet observed on): the sums of the increments up to it."""
        return _levels(self._increments)

    def unobserved(self) -> list[int]:
        """The budgets no step has taught yet."""
        return [s for s in self.budgets if self._increments[s] is None]

    def learn(self, accepted_nodes: Sequence[Sequence[int]], rows: Sequence[Hashable] | None,
              up_to: int | None = None, above: int | None = None) -> None:
        """A step's accepted paths (node indices, per row) teach the budgets up to `up_to`
        (what the verified trees held) or above `above` (trees scored in hindsight, hindsight.py)
        ; `rows`: the rows' sequence keys, or None."""
        entries = self._entries(rows)
        for s in self.budgets:
            if (up_to is None or s <= up_to) and (above is None or s > above):
                self._learn_one(s, accepted_nodes, entries)

    def _row(self, key: Hashable) -> tuple[dict[int, float], dict[int, int]]:
        """A sequence's own increments, made from the global ones when it is new."""
        entry = self._rows.get(key)
        if entry is None:
            entry = self._rows[key] = (
                {s: v for s, v in self._increments.items() if v is not None},
                {s: ROW_PRIOR_WEIGHT for s in self._increments})
            while len(self._rows) > MAX_ROWS:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(key)
        return entry

    def _entries(self, rows: Sequence[Hashable] | None) -> list[tuple[dict[int, float],
                                                                          dict[int, int]]]:
        """Each row's own estimates (none without keys), looked up once per step."""
        return [] if rows is None else [self._row(key) for key in rows]

    def batch(self, rows: Sequence[Hashable] | None) -> dict[int, float]:
        """Per budget, the accepted draft tokens a step of these rows is expected to get: the
        mean of the rows' own estimates. A batch's acceptance is that of the sequences in it,
        which come and go: one global average lags the change of company (the long answers
        left at the end of a batch accept more than the batch did) or, made to follow it,
        chases the noise of a few rows."""
        if not rows:
            return self.expected
        sums = dict.fromkeys(self._increments, 0.0)
        for estimates, _ in self._entries(rows):
            for s in sums:
                sums[s] += estimates.get(s, self._increments[s])
        return _levels({s: total / len(rows) for s, total in sums.items()})

    def _learn_one(self, s: int, accepted_nodes: Sequence[Sequence[int]],
                          entries: list[tuple[dict[int, float], dict[int, int]]]) -> None:
        """What a tree of budget s, the first s nodes, accepted beyond the tree of the next
        smaller budget: each path cut at its first node >= s (indices grow along a path) less
        the same path cut at the smaller budget. Learned globally (the prior of new sequences,
        and what `save` keeps) and in each row's `entries` (`_entries`)."""
        below = self._below[s]
        counts = [sum(1 for node in path if below <= node < s) for path in accepted_nodes]
        for (estimates, weights), count in zip(entries, counts):
            weights[s] = weights.get(s, 0) + 1
            old = estimates.get(s, float(count))
            estimates[s] = old + max(self.row_decay, 1.0 / weights[s]) * (count - old)
        mean = sum(counts) / len(counts)
        # A running mean over rows while few are behind the estimate: a step of 8 rows weighs
        # as 8 steps of one, so a large batch does not serve dozens of steps at a prior's
        # budget that its own trees already contradict. Then a moving average over steps, each
        # step's mean one observation: a batch's acceptance changes as its prompts come and go,
        # not row by row, and a memory counted in rows would chase the noise of a few rows.
        num_rows = len(accepted_nodes)
        self._weights[s] += num_rows
        rate = max(self.decay, num_rows / self._weights[s])
        old = self._increments[s]
        self._increments[s] = mean if old is None else old + rate * (mean - old)

    def save(self, path: str | os.PathLike) -> None:
        """The global estimates, as the prior of a later start (`load_acceptance`)."""
        write_json(path, {"expected_accepted": {str(s): v for s, v in self.expected.items()
                                                 if v is not None},
                          "saved_at": time.time()})


def _levels(increments: dict[int, float | None]) -> dict[int, float | None]:
    """Budget -> accepted draft tokens, the increments (ascending budgets) summed up to it;
    None from the first unknown increment on."""
    levels: dict[int, float | None] = {}
    total: float | None = 0.0
    for s in sorted(increments):
        increment = increments[s]
        total = None if total is None or increment is None else total + increment
        levels[s] = total
    return levels


def load_acceptance(path: str | os.PathLike) -> dict[int, float] | None:
    """Acceptance estimates saved by `AcceptanceEstimates.save`, or None."""
    try:
        with open(path) as f:
            raw = json.load(f)
        return {int(s): float(v) for s, v in raw["expected_accepted"].items()}
    except (FileNotFoundError, KeyError, ValueError, json.JSONDecodeError):
        return None
