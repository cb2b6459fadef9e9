"""Choosing the speculation budget s_q for the current batch size (docs/architecture.md).

- `FixedBudget`: always the same budget (1: plain decoding).
- `RuleBudget`: the paper's rule, s_q = I_knee / b, capped ("SSSD: Simply-Scalable Speculative
  Decoding", arXiv 2411.05894, Section 3.2).
- `MeasuredBudget`: the s_q that maximizes E[emitted tokens | s_q] / t(b, s_q), with t from the
  forward profile (forward_profile.py) corrected by the steps it observes, and E learned online.

The measurements behind the constants below are in bench/results/ (the folders named).
"""

from __future__ import annotations

import logging
import os
import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Protocol

from sssd.verifier.engine.acceptance_estimates import ROW_DECAY, AcceptanceEstimates
from sssd.verifier.engine.budget_rule import speculation_budget
from sssd.verifier.engine.forward_profile import ForwardProfile

logger = logging.getLogger(__name__)

PROFILE_WEIGHT = 8  # a profiled step time counts as this many observed ones
# A settled next budget more than FAR_BEHIND below the best rate is explored FAR_EXPLORE_FACTOR
# times more rarely. Not before it has settled (RECENT_STEPS steps): on fewer, a burst of slow
# steps of a shared machine can be most of what it was timed on.
FAR_BEHIND = 0.2
FAR_EXPLORE_FACTOR = 8
# A (batch size, budget)'s step time is the median of its last RECENT_STEPS observed steps once
# it has CALIBRATION_STEPS of them: one slow step moves it not at all, a machine that changed
# moves it within a few steps.
CALIBRATION_STEPS = 3
RECENT_STEPS = 9
# A settled (batch size, budget) that does not set the pace is re-timed against the pace at each
# of its steps: its estimate moves RETIME_RATE of the way (in logarithms) to what the step says,
# that word capped at RETIME_CLIP either way (4.9 % at most a step). It may have settled in a
# slow or fast spell that the budget setting the pace did not share; a capped step is a robust
# mean of a shared machine's skewed step times, where a median of a few steps jumps on noise
# (bench/results/2026-12-01-xeon-9).
RETIME_RATE = 0.5
RETIME_CLIP = 1.1
# Once trees have run, a budget not yet calibrated at a batch size is assumed to cost at least its
# profiled time times the median ratio of observed to profiled time of the trees' (batch size,
# budget)s so far, less this fraction: the profile's shape is believed, its scale is measured.
PROFILE_AGREES = 0.15
CALIBRATED_EXPLORE_FACTOR = 4  # a calibrated neighbour is explored this much more rarely
SAME_COST = 1.02  # step times within 2 % count as the same cost
# Rates within 1 % of the best count as a near-tie, which goes to the smaller budget: a step
# decided by the tolerance may give up as much rate as the tolerance (3 % ran budget 8 on a
# third of the steps where 16 was best by 4-5 %; bench/results/2026-11-30-xeon-3).
TIE_TOLERANCE = 0.01
# How fast the machine runs now against when the step times were learned (the pace): the median,
# over the last PACE_STEPS steps at settled (b, s)s, of each step's time over its (b, s)'s
# settled estimate. A settled estimate is kept in the units of the pace it was learned at and
# only the pace moves, so a slow spell slows every budget's estimate alike instead of pricing
# whichever budget was timed during it; the budget setting the pace never moves its own
# estimate, so the two cannot drift apart. Steps at a (b, s) not yet settled are divided by the
# pace of their moment, which only settled steps move; 5 steps, not 9, so the pace follows a
# spell of 10 steps instead of lagging it.
PACE_STEPS = 5
PLAIN_HINDSIGHT_FACTOR = 4  # hindsight trees at budget 1 come this much more rarely
HINDSIGHT_EVERY = 4  # every this many-th drafter call drafts the largest tree (MeasuredBudget)


class BudgetPolicy(Protocol):
    def budget(self, batch_size: int, rows: Sequence[Hashable] | None = None) -> int:
        """The budget of a step of `batch_size` rows; `rows`, when given, names the sequences
        (one key each, as `observe` gets them), whose own acceptance a policy may weigh."""

    def observe(self, batch_size: int, budget: int, accepted_nodes: Sequence[Sequence[int]],
                step_s: float | None, rows: Sequence[Hashable] | None = None) -> None:
        """After a step at `budget`: per row, the tree nodes of its accepted path; the seconds
        the step's speculation work took (drafting, verification, acceptance), None when they
        say nothing about `budget` (a step that drafted a larger tree than it verified, or one
        whose forward pass also prefilled a prompt); the rows' keys, as `budget` got them."""

    def draft_budget(self, batch_size: int, budget: int) -> int:
        """The budget to draft at when `budget` is verified: larger on the steps whose extra
        nodes are to be scored in hindsight (`hindsight.py`), else `budget`. Called only for
        proposers whose trees are best-first and cheap to draft (`Proposer.hindsight_drafts`)."""

    def observe_hindsight(self, batch_size: int, verified_budget: int,
                          accepted_nodes: Sequence[Sequence[int]],
                          rows: Sequence[Hashable] | None = None) -> None:
        """A step's drafted trees scored in hindsight: per row, the accepted path through the
        whole tree, of which nodes below `verified_budget` were verified too."""


class _NoHindsight:
    def draft_budget(self, batch_size: int, budget: int) -> int:
        return budget

    def observe_hindsight(self, batch_size: int, verified_budget: int,
                          accepted_nodes: Sequence[Sequence[int]],
                          rows: Sequence[Hashable] | None = None) -> None:
        pass


class FixedBudget(_NoHindsight):
    """Always the same budget; 1 means plain autoregressive decoding."""

    def __init__(self, budget: int) -> None:
        self._budget = budget

    def budget(self, batch_size: int, rows: Sequence[Hashable] | None = None) -> int:
        return self._budget

    def observe(self, batch_size: int, budget: int, accepted_nodes: Sequence[Sequence[int]],
                step_s: float | None, rows: Sequence[Hashable] | None = None) -> None:
        pass


class RuleBudget(_NoHindsight):
    def __init__(self, knee_intensity: float, max_budget: int) -> None:
        self.knee_intensity = knee_intensity
        self.max_budget = max_budget

    def budget(self, batch_size: int, rows: Sequence[Hashable] | None = None) -> int:
        return speculation_budget(batch_size, self.knee_intensity, self.max_budget)

    def observe(self, batch_size: int, budget: int, accepted_nodes: Sequence[Sequence[int]],
                step_s: float | None, rows: Sequence[Hashable] | None = None) -> None:
        pass


class MeasuredBudget:
    """argmax over s_q of E[emitted tokens | s_q] / t(b, s_q), both learned online.

    Acceptance. E[emitted | s_q] = 1 + E[accepted | s_q], learned for every budget from every
    step (acceptance_estimates.py). With row keys (`budget(b, rows)`, `observe(..., rows)`) a
    step's expectation is the mean over its rows' own estimates. They start from a prior (what
    `save_stats` kept from an earlier run, else the default prior), so a fresh server
    speculates from its first step; without a prior the first step runs at the largest budget,
    which measures all of them at once.

    Budgets above the one in use are learned in hindsight where the proposer allows it: every
    `hindsight_every`-th step drafts at the largest budget, verifies the first `budget` nodes
    and scores the rest against the tokens the sequence goes on to emit (hindsight.py), at the
    cost of a drafter call instead of a larger forward pass. Until the first score arrives (and
    always for other proposers) they are learned by exploration: every `explore_every`-th step
    runs the next larger budget than the best (FAR_EXPLORE_FACTOR times more rarely while that
    one is settled and FAR_BEHIND behind). With hindsight, what is left to learn is what the
    neighbouring budgets' steps cost: the next smaller budget is explored on that schedule
    (down to budget 1, the fallback) and the next larger one half as often.

    Step times. A (b, s_q) starts from the profile (worth PROFILE_WEIGHT steps); the engine's
    observed steps, drafting and acceptance included, replace it by the median of the last
    RECENT_STEPS from the CALIBRATION_STEPS-th step on. Observed steps are divided by the pace
    (PACE_STEPS), and a (b, s_q) with RECENT_STEPS steps settles (RETIME_RATE). A wrong profile
    must not keep a budget out for long: a budget costs at most what a larger budget was
    measured to cost at this batch size, and at least what the largest smaller budget observed
    costs; a budget not yet calibrated whose rate at that lower bound would beat the best is run
    until it is (`_to_calibrate`), so a profile taken on a busy machine is corrected within a
    few dozen steps, each (b, s_q) calibrated at most CALIBRATION_STEPS times. A (b, s_q) not
    yet observed is priced at its profiled time times what the profile was off by for the same
    budget at the nearest calibrated batch size, and once trees have run no lower than
    PROFILE_AGREES below the trees' median ratio: a profile the steps confirm is not
    second-guessed at budgets it prices far out.

    Near-ties (rates within `tie_tolerance`) go to the smaller budget: it costs less drafting
    and cache room for nothing. The step never touches the disk: a serving loop's observer calls
    `save_stats`, whose estimates are the next start's prior.
    """

    def __init__(self, profile: ForwardProfile, max_budget: int, decay: float = 0.05,
                 explore_every: int = 8, tie_tolerance: float = TIE_TOLERANCE,
                 prior: dict[int, float] | None = None,
                 hindsight_every: int = HINDSIGHT_EVERY, row_decay: float = ROW_DECAY) -> None:
        self.profile = profile
        self.candidates = sorted(((j, s) for j, s in enumerate(profile.budgets) if s <= max_budget),
                                 key=lambda candidate: candidate[1])  # ascending budgets
        if not self.candidates:
            raise ValueError("no profiled budget is <= max_budget")
        if not 0 < decay <= 1 or not 0 < row_decay <= 1 or explore_every < 2 or \
                hindsight_every < 0:
            raise ValueError("need 0 < decay <= 1, 0 < row_decay <= 1, explore_every >= 2 and "
                             "hindsight_every >= 0")
        self.explore_every = explore_every
        self.hindsight_every = hindsight_every  # 0: never draft beyond the verified budget
        self._num_draft_calls = 0
        self._has_hindsight = False  # scores in hindsight arrive: explore downwards
        self.tie_tolerance = tie_tolerance
        self.acceptance = AcceptanceEstimates([s for _, s in self.candidates], decay, row_decay,
                                              prior)
        # (b, s) -> estimate, in seconds at the pace the machine had when they were learned
        self.observed_seconds: dict[tuple[int, int], float] = {}
        self.pace = 1.0  # a step now takes this times its estimate
        # the last settled steps' (batch size, budget) and time over its estimate
        self._pace_ratios: deque[tuple[tuple[int, int], float]] = deque(maxlen=PACE_STEPS)
        # (b, s) -> median of its recent steps / its profiled time; the median of the trees'
        self._ratios: dict[tuple[int, int], float] = {}
        self._tree_ratio: float | None = None
        self._calibrated_batches: dict[int, set[int]] = {}  # s -> batch sizes calibrated at s
        self._seconds_weights: dict[tuple[int, int], int] = {}  # steps behind each estimate
        self._recent_seconds: dict[tuple[int, int], deque[float]] = {}  # last observed steps
        self._num_calls = 0
        # The last budget() was an exploration or calibration step: it is there to time its
        # budget, so it is not also a hindsight step (whose time says nothing about it).
        self._is_timing_step = False
        self._last_unsettled = False  # the last timed step was at a (b, s) not yet settled

    @property
    def expected_accepted(self) -> dict[int, float | None]:
        """Mean accepted draft tokens per row at each budget (AcceptanceEstimates.expected)."""
        return self.acceptance.expected

    @property
    def row_decay(self) -> float:
        return self.acceptance.row_decay

    def budget(self, batch_size: int, rows: Sequence[Hashable] | None = None) -> int:
        self._num_calls += 1
        self._is_timing_step = True
        unobserved = self.acceptance.unobserved()
        if unobserved:
            return max(unobserved)  # one step there measures every smaller budget too
        accepted = self.acceptance.batch(rows)

        seconds = [self.observed_seconds[(batch_size, s)] if (batch_size, s) in
                   self.observed_seconds else self._expected_seconds(batch_size, j, s)
                   for j, s in self.candidates]
        # A smaller budget costs at most what a larger one was measured to cost: a profile
        # that overprices it must not keep it out until it is explored.
        cap = float("inf")
        capped = [False] * len(seconds)  # priced above a larger budget's measured cost
        for i in reversed(range(len(seconds))):
            capped[i] = seconds[i] > cap
            seconds[i] = min(seconds[i], cap)
            if self._calibrated(batch_size, self.candidates[i][1]):
                cap = seconds[i]
        rates = [(1.0 + accepted[s]) / t for (_, s), t in zip(self.candidates, seconds)]
        threshold = (1.0 - self.tie_tolerance) * max(rates)
        best = next(i for i, r in enumerate(rates) if r >= threshold)  # smallest near-best
        # ... unless the next budget costs the same (on a CPU, trees of up to 4 nodes run as
        # one product of 4 rows): then its strictly higher rate is free, and near-ties that
        # hindsight's slower learning of the larger budget creates must not keep it out.
        while best + 1 < len(rates) and seconds[best + 1] <= SAME_COST * seconds[best] and \
                rates[best + 1] > rates[best]:
            best += 1
        choice = self._to_calibrate(batch_size, seconds, capped, rates[best], accepted)
        if choice is None:
            choice = self._explore(batch_size, best, rates)
        if choice is None:
            self._is_timing_step = False
            choice = self.candidates[best][1]
        if self._last_unsettled and not self._settled(batch_size, choice):  # see PACE_STEPS
            settled = [i for i, (_, s) in enumerate(self.candidates)
                       if self._settled(batch_size, s)]
            if settled:
                self._is_timing_step = True  # it is there to time the pace
                return self.candidates[max(settled, key=lambda i: rates[i])][1]
        return choice

    def _explore(self, batch_size: int, best: int, rates: list[float]) -> int | None:
        # Without hindsight the next larger budget is explored (its acceptance); with it the
        # next smaller one (its step time) and, half as often, the next larger one (its step
        # time: one slow step must not price it out for good). Often while the neighbour is
        # close to the best, rarely once it is far behind, since exploring a clear loser costs
        # its whole gap every time.
        # At the largest budget no tree is drafted beyond it, so no hindsight score ever comes:
        # the next smaller one is explored all the same, or a profile that overprices it (one
        # taken on a slower hour) keeps the policy at the top for good (SmolLM2 on code, end to
        # end: budget 32 on 698 of 703 steps, 16 timed once, 0.87 of fixed 16).
        neighbours = [(best - 1, 1, 0), (best + 1, 2, self.explore_every)] \
            if self._has_hindsight or best + 1 == len(self.candidates) else [(best + 1, 1, 0)]
        for other, slower, offset in neighbours:
            if 0 <= other < len(self.candidates):
                observed = self._num_observed(batch_size, self.candidates[other][1])
                close = rates[other] >= (1.0 - FAR_BEHIND) * rates[best] or \
                    0 < observed < RECENT_STEPS  # not yet settled: see FAR_BEHIND
                every = slower * self.explore_every * (1 if close else FAR_EXPLORE_FACTOR)
                if self._calibrated(batch_size, self.candidates[other][1]):
                    every *= CALIBRATED_EXPLORE_FACTOR
                if (self._num_calls + offset) % every == 0:
                    return self.candidates[other][1]
        return None

    def _settled(self, batch_size: int, budget: int) -> bool:
        return self._num_observed(batch_size, budget) >= RECENT_STEPS

    def _num_observed(self, batch_size: int, budget: int) -> int:
        return len(self._recent_seconds.get((batch_size, budget), ()))

    def _calibrated(self, batch_size: int, budget: int) -> bool:
        return self._num_observed(batch_size, budget) >= CALIBRATION_STEPS

    def _to_calibrate(self, batch_size: int, seconds: list[float], capped: list[bool],
                      best_rate: float, accepted: dict[int, float]) -> int | None:
        """The smallest budget not yet calibrated at this batch size whose rate would beat
        `best_rate` at its lowest possible cost: the cost of the largest smaller budget observed
        here (step costs do not fall as budgets grow), or, once trees have run, its profiled
        cost rescaled by the trees' median ratio less PROFILE_AGREES if that is more. A budget
        below every one observed here has no floor; where its estimate was `capped` (the
        profile prices it above what a larger budget was measured to cost, so the profile is
        off there), the rescaled profile alone bounds it: a profile taken under load prices
        every budget alike too high, and a smaller budget capped at a larger one's measured
        cost would otherwise never beat it and never be timed."""
        floor = None  # the estimated cost of the largest smaller budget observed so far
        for (j, s), t, is_capped in zip(self.candidates, seconds, capped):
            observed = self._num_observed(batch_size, s)
            if not self._calibrated(batch_size, s) and (floor is not None or is_capped):
                rescaled = None
                if s in self._calibrated_batches:
                    rescaled = (1.0 - PROFILE_AGREES) * self._expected_seconds(batch_size, j, s)
                elif self._tree_ratio is not None:
                    rescaled = (1.0 - PROFILE_AGREES) * self._tree_ratio * \
                        self.profile.time(batch_size, j)
                lowest = max((c for c in (floor, rescaled) if c is not None), default=None)
                if lowest is not None and lowest < t and \
                        (1.0 + accepted[s]) / lowest > (1.0 + self.tie_tolerance) * best_rate:
                    return s
            if observed:
                floor = t if floor is None else max(floor, t)
        return None

    def observe(self, batch_size: int, budget: int, accepted_nodes: Sequence[Sequence[int]],
                step_s: float | None, rows: Sequence[Hashable] | None = None) -> None:
        if not accepted_nodes:
            return
        if step_s is not None:
            self._learn_seconds(batch_size, budget, step_s)
        self.acceptance.learn(accepted_nodes, rows, up_to=budget)

    def _expected_seconds(self, batch_size: int, index: int, budget: int) -> float:
        """What (batch_size, budget) should cost before its own steps tell: its profiled time,
        rescaled by what the profile was off by for the same budget where it was calibrated
        (at the nearest batch size, the larger of two as near)."""
        profiled = self.profile.time(batch_size, index)
        seen = self._calibrated_batches.get(budget)
        if not seen:
            return profiled
        nearest = min(seen, key=lambda b: (abs(b - batch_size), -b))
        return profiled * self._ratios[(nearest, budget)]

    def _learn_seconds(self, batch_size: int, budget: int, step_s: float) -> None:
        key = (batch_size, budget)
        recent = self._recent_seconds.setdefault(key, deque(maxlen=RECENT_STEPS))
        self._last_unsettled = len(recent) < RECENT_STEPS
        if len(recent) == RECENT_STEPS:
            # Settled: its estimate (the median of those steps) is kept, and the step moves only
            # the pace. A median, not a moving mean: step times are skewed to the slow side, and
            # their mean ratio to a median estimate is above 1.
            ratio = step_s / self.observed_seconds[key]
            setters = sum(1 for other, _ in self._pace_ratios if other == key)
            if 2 * setters < len(self._pace_ratios):  # run now and then: re-time it (RETIME_RATE)
                off = min(max(ratio / self.pace, 1.0 / RETIME_CLIP), RETIME_CLIP) ** RETIME_RATE
                self.observed_seconds[key] *= off
                ratio /= off
            self._pace_ratios.append((key, ratio))
            self.pace = statistics.median(r for _, r in self._pace_ratios)
            return
        step_s /= self.pace  # what the step would have taken at the estimates' pace
        index = next((j for j, s in self.candidates if s == budget), None)
        profiled = None if index is None else self.profile.time(batch_size, index)
        old_seconds = self.observed_seconds.get(key)
        if old_seconds is None:
            # The expected time is the prior, worth PROFILE_WEIGHT steps: one slow step (the
            # first tree of a shape, a busy moment) must not price a budget out for good.
            old_seconds = step_s if index is None else \
                self._expected_seconds(batch_size, index, budget)
            self._seconds_weights[key] = 0 if profiled is None else PROFILE_WEIGHT
        self._seconds_weights[key] += 1
        recent.append(step_s)
        median = statistics.median(recent)  # a few values: numpy's call costs more
        if len(recent) >= CALIBRATION_STEPS:
            self.observed_seconds[key] = median
        else:  # the profile's time still counts: one slow first step must not decide
            rate = 1.0 / self._seconds_weights[key]
            self.observed_seconds[key] = old_seconds + rate * (step_s - old_seconds)
        if profiled is None:
            return
        self._ratios[key] = median / profiled
        if len(recent) >= CALIBRATION_STEPS:
            self._calibrated_batches.setdefault(budget, set()).add(batch_size)
        # A plain step (budget 1) says nothing of what a tree costs: only trees rescale the
        # profile of other budgets (one taken under load may be right at 1 and off above it).
        if budget > 1:
            self._tree_ratio = statistics.median(r for (_, s), r in self._ratios.items() if s > 1)

    def draft_budget(self, batch_size: int, budget: int) -> int:
        largest = self.candidates[-1][1]
        if not self.hindsight_every or budget >= largest or self._is_timing_step:
            return budget
        self._num_draft_calls += 1
        # At budget 1 the step calls no proposer: a hindsight tree is a whole drafter call, not
        # a larger one of a call made anyway, so it comes PLAIN_HINDSIGHT_FACTOR times as rarely.
        every = self.hindsight_every * (PLAIN_HINDSIGHT_FACTOR if budget == 1 else 1)
        return largest if self._num_draft_calls % every == 0 else budget

    def observe_hindsight(self, batch_size: int, verified_budget: int,
                          accepted_nodes: Sequence[Sequence[int]],
                          rows: Sequence[Hashable] | None = None) -> None:
        """Learns the budgets above `verified_budget` (`observe` learned the others)."""
        if not accepted_nodes:
            return
        self._has_hindsight = True
        self.acceptance.learn(accepted_nodes, rows, above=verified_budget)

    def save_stats(self, path: str | os.PathLike) -> None:
        """The acceptance estimates, as the prior of a later start
        (acceptance_estimates.load_acceptance)."""
        self.acceptance.save(path)
