"""How many bonus tokens to predict after each verification outcome.

A round sends the drafts s_1..s_K. The verifier accepts k of them (0 <= k <= K) and adds one
bonus token, so the outcome is (k, bonus). The speculator predicts, for each k, F_k candidate
bonus tokens and drafts ahead for each: B = sum F_k predicted outcomes in all.

Geometric fan-out (SSD paper, Theorem 12): with acceptance rate a, P(k) = a^k (1 - a) for k < K
and P(K) = a^K, and a miss rate that falls as a power law in the fan-out, miss(F) ~ F^-r, the
expected hit rate sum_k P(k) (1 - miss(F_k)) under sum F_k = B is maximal at
F_k proportional to P(k)^(1/(1+r)).

`FanoutEstimator` learns a and r online from the outcomes it is shown.
"""

from __future__ import annotations

import math

import numpy as np

FANOUTS = ("geometric", "uniform")


def outcome_probabilities(acceptance: float, lookahead: int) -> np.ndarray:
    """[lookahead + 1] P(k accepted) under i.i.d. acceptance at rate `acceptance`."""
    a = min(max(acceptance, 1e-6), 1 - 1e-6)
    k = np.arange(lookahead + 1)
    probs = a ** k * (1 - a)
    probs[lookahead] = a ** lookahead
    return probs


def geometric_weights(acceptance: float, miss_exponent: float, lookahead: int) -> np.ndarray:
    """[lookahead + 1] real-valued optimal fan-out, normalised to sum 1: F_k ∝ P(k)^(1/(1+r)),
    that is F_0 c^k for k < K and F_0 c^K (1-a)^(-1/(1+r)) for k = K, c = a^(1/(1+r))."""
    if miss_exponent <= 0:
        raise ValueError(f"miss_exponent must be > 0, got {miss_exponent}")
    weights = outcome_probabilities(acceptance, lookahead) ** (1.0 / (1.0 + miss_exponent))
    return weights / weights.sum()


def round_fanout(weights: np.ndarray, budget: int) -> list[int]:
    """Integers >= 1 that sum to `budget` and follow `weights` (largest remainders)."""
    num = weights.shape[0]
    if budget < num:
        raise ValueError(f"a fan-out budget of {budget} cannot give each of {num} outcomes one "
                         "prediction")
    # One each first, the rest split in proportion.
    spare = budget - num
    ideal = weights * spare
    counts = np.floor(ideal).astype(np.int64)
    remainder = ideal - counts
    for index in np.argsort(-remainder, kind="stable")[: spare - int(counts.sum())]:
        counts[index] += 1
    return [int(c) + 1 for c in counts]


def fanout(kind: str, budget: int, lookahead: int, acceptance: float,
           miss_exponent: float) -> list[int]:
    """[lookahead + 1] F_0..F_K: predicted bonus tokens per outcome k, summing to `budget`."""
    if kind == "uniform":
        weights = np.full(lookahead + 1, 1.0 / (lookahead + 1))
    elif kind == "geometric":
        weights = geometric_weights(acceptance, miss_exponent, lookahead)
    else:
        raise ValueError(f"fanout must be one of {FANOUTS}, got {kind!r}")
    return round_fanout(weights, budget)


class FanoutEstimator:
    """Online estimates of the acceptance rate a and the miss exponent r.

    a: accepted drafts over drafts offered (each draft position is one Bernoulli trial until the
    first rejection), with a prior of `prior_weight` trials at `prior_acceptance`.
    r: a least-squares fit of log miss(F) = c - r log F over the fan-outs seen, where miss(F) is
    the fraction of outcomes whose k had F predictions and whose bonus was not among them; kept
    at the prior until two fan-out values have `min_count` observations each.
    """

    def __init__(self, prior_acceptance: float = 0.6, prior_miss_exponent: float = 1.0,
                 prior_weight: float = 20.0, min_count: int = 20) -> None:
        self._accepted = prior_acceptance * prior_weight
        self._trials = prior_weight
        self._prior_r = prior_miss_exponent
        self._min_count = min_count
        self._seen: dict[int, list[int]] = {}  # F -> [outcomes, misses]

    @property
    def acceptance(self) -> float:
        return self._accepted / self._trials

    def observe(self, num_offered: int, num_accepted: int, fanout_at_k: int | None,
                hit: bool) -> None:
        """One outcome: `num_accepted` of `num_offered` drafts; `fanout_at_k` predictions were
        made for that k (None: nothing was predicted, e.g. after a fallback)."""
        if num_offered > 0:
            self._accepted += num_accepted
            # Trials: every accepted position, and the rejected one unless all were accepted.
            self._trials += num_accepted + (1 if num_accepted < num_offered else 0)
        if fanout_at_k is not None and fanout_at_k > 0:
            counts = self._seen.setdefault(fanout_at_k, [0, 0])
            counts[0] += 1
            counts[1] += 0 if hit else 1

    @property
    def miss_exponent(self) -> float:
        points = [(math.log(f), math.log(max(misses, 0.5) / total))
                  for f, (total, misses) in self._seen.items() if total >= self._min_count]
        if len(points) < 2:
            return self._prior_r
        x = np.array([p[0] for p in points])
        y = np.array([p[1] for p in points])
        slope = float(np.polyfit(x, y, 1)[0])
        # A rising or flat miss curve says nothing useful about r: clamp to a sane range.
        return min(max(-slope, 0.1), 4.0)
