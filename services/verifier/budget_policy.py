"""Choosing the speculation budget s_q for the current batch size (DESIGN.md section 6).

- `RuleBudget`: the paper's rule, s_q = I_knee / b, capped (seeds/000 Section 3.2).
- `MeasuredBudget`: profiles the forward-pass time t(b, s_q) of the actual model on the actual
  device, tracks the accepted tokens per step for each budget online, and picks the s_q that
  maximizes E[emitted tokens | s_q] / t(b, s_q).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from sssd.common.budget import speculation_budget

logger = logging.getLogger(__name__)

DEFAULT_BUDGETS = (1, 2, 4, 8, 16, 32)
DEFAULT_BATCHES = (1, 2, 4, 8)


class BudgetPolicy(Protocol):
    def budget(self, batch_size: int) -> int: ...

    def observe(self, batch_size: int, budget: int, accepted: Sequence[int],
                verify_s: float) -> None: ...


class FixedBudget:
    """Always the same budget; 1 means plain autoregressive decoding."""

    def __init__(self, budget: int) -> None:
        self._budget = budget

    def budget(self, batch_size: int) -> int:
        return self._budget

    def observe(self, batch_size: int, budget: int, accepted: Sequence[int],
                verify_s: float) -> None:
        pass


class RuleBudget:
    def __init__(self, knee_intensity: float, max_budget: int) -> None:
        self.knee_intensity = knee_intensity
        self.max_budget = max_budget

    def budget(self, batch_size: int) -> int:
        return speculation_budget(batch_size, self.knee_intensity, self.max_budget)

    def observe(self, batch_size: int, budget: int, accepted: Sequence[int],
                verify_s: float) -> None:
        pass


class ForwardProfile:
    """t(b, s_q) in seconds on a grid; interpolated in b, looked up in s_q."""

    def __init__(self, batches: Sequence[int], budgets: Sequence[int], seconds: np.ndarray) -> None:
        self.batches = list(batches)
        self.budgets = list(budgets)
        self.seconds = np.asarray(seconds, dtype=np.float64)  # [num_batches, num_budgets]

    def time(self, batch_size: int, budget_index: int) -> float:
        return float(np.interp(batch_size, self.batches, self.seconds[:, budget_index]))

    @classmethod
    def measure(cls, forward: Callable[[int, int], float], batches: Sequence[int] = DEFAULT_BATCHES,
                budgets: Sequence[int] = DEFAULT_BUDGETS, repeats: int = 3) -> "ForwardProfile":
        """`forward(b, s)` runs one verification forward and returns its duration in seconds."""
        seconds = np.zeros((len(batches), len(budgets)))
        for i, b in enumerate(batches):
            for j, s in enumerate(budgets):
                forward(b, s)  # warm-up
                seconds[i, j] = np.median([forward(b, s) for _ in range(repeats)])
        return cls(batches, budgets, seconds)

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump({"batches": self.batches, "budgets": self.budgets,
                       "seconds": self.seconds.tolist(), "measured_at": time.time()}, f)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ForwardProfile":
        with open(path) as f:
            raw = json.load(f)
        return cls(raw["batches"], raw["budgets"], np.asarray(raw["seconds"]))


class MeasuredBudget:
    """argmax over s_q of E[emitted tokens | s_q] / t(b, s_q), E learned online.

    E[emitted | s_q] = 1 + E[accepted | s_q] is tracked per budget with an exponential moving
    average. Budgets not yet tried start optimistic (as if every node were accepted along a
    chain of log2(s_q) + 1) so each gets measured; the average then corrects them.
    """

    def __init__(self, profile: ForwardProfile, max_budget: int, decay: float = 0.1,
                 tie_tolerance: float = 0.05) -> None:
        self.profile = profile
        self.tie_tolerance = tie_tolerance
        self.candidates = [(j, s) for j, s in enumerate(profile.budgets) if s <= max_budget]
        if not self.candidates:
            raise ValueError("no profiled budget is <= max_budget")
        self.decay = decay
        self.expected_accepted = {s: float(np.log2(s)) + 1.0 if s > 1 else 0.0
                                  for _, s in self.candidates}

    def budget(self, batch_size: int) -> int:
        def rate(candidate: tuple[int, int]) -> float:
            index, s = candidate
            return (1.0 + self.expected_accepted[s]) / self.profile.time(batch_size, index)

        # Near-ties go to the smaller budget: it costs less drafting and cache room for nothing.
        best = max(rate(c) for c in self.candidates)
        return min(s for index, s in self.candidates
                   if rate((index, s)) >= (1.0 - self.tie_tolerance) * best)

    def observe(self, batch_size: int, budget: int, accepted: Sequence[int],
                verify_s: float) -> None:
        if budget not in self.expected_accepted or not accepted:
            return
        mean = float(np.mean(accepted))
        old = self.expected_accepted[budget]
        self.expected_accepted[budget] = old + self.decay * (mean - old)
