"""The geometric fan-out (Theorem 12) and its online estimates: no model, no service."""

import numpy as np
import pytest

from sssd.speculator.fanout import (
    FanoutEstimator,
    fanout,
    geometric_weights,
    outcome_probabilities,
    round_fanout,
)


@pytest.mark.parametrize("a,r,lookahead,budget", [
    (0.8, 1.0, 3, 12), (0.5, 0.5, 4, 20), (0.95, 2.0, 7, 24), (0.2, 1.0, 2, 3), (0.7, 0.3, 5, 64)])
def test_split_sums_to_the_budget_and_gives_every_outcome_one(a, r, lookahead, budget):
    counts = fanout("geometric", budget, lookahead, a, r)
    assert len(counts) == lookahead + 1
    assert sum(counts) == budget
    assert min(counts) >= 1


@pytest.mark.parametrize("a,r", [(0.8, 1.0), (0.6, 0.5), (0.9, 2.0)])
def test_weights_match_the_closed_form(a, r):
    lookahead = 5
    weights = geometric_weights(a, r, lookahead)
    c = a ** (1 / (1 + r))
    closed = np.array([c ** k for k in range(lookahead)]
                      + [c ** lookahead * (1 - a) ** (-1 / (1 + r))])
    np.testing.assert_allclose(weights, closed / closed.sum(), rtol=1e-12)
    # Proportional to P(k)^(1/(1+r)), the statement of the theorem.
    direct = outcome_probabilities(a, lookahead) ** (1 / (1 + r))
    np.testing.assert_allclose(weights, direct / direct.sum(), rtol=1e-12)


def test_integer_split_follows_the_weights():
    # a = 0.5, r = 1, K = 3: P = (1/2, 1/4, 1/8, 1/8), weights ∝ sqrt(P).
    counts = fanout("geometric", 40, 3, 0.5, 1.0)
    ideal = geometric_weights(0.5, 1.0, 3) * 40
    assert np.all(np.abs(np.array(counts) - ideal) <= 1.0)
    assert counts[0] > counts[1] > counts[2]


def test_uniform_split():
    assert fanout("uniform", 12, 3, 0.9, 1.0) == [3, 3, 3, 3]
    assert sum(fanout("uniform", 13, 3, 0.9, 1.0)) == 13


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="cannot give each"):
        round_fanout(np.ones(4) / 4, 3)
    with pytest.raises(ValueError, match="fanout must be one of"):
        fanout("zipf", 12, 3, 0.5, 1.0)
    with pytest.raises(ValueError, match="miss_exponent"):
        geometric_weights(0.5, 0.0, 3)


def test_estimator_learns_acceptance_and_miss_exponent():
    rng = np.random.default_rng(0)
    estimator = FanoutEstimator(prior_acceptance=0.5, prior_miss_exponent=1.0)
    true_a, true_r, lookahead = 0.8, 1.5, 4
    for _ in range(4000):
        k = 0
        while k < lookahead and rng.random() < true_a:
            k += 1
        f = int(rng.choice([1, 2, 4, 8]))
        hit = rng.random() > 0.9 * f ** -true_r
        estimator.observe(lookahead, k, f, hit)
    assert estimator.acceptance == pytest.approx(true_a, abs=0.03)
    assert estimator.miss_exponent == pytest.approx(true_r, abs=0.25)


def test_estimator_keeps_its_prior_without_data():
    estimator = FanoutEstimator(prior_acceptance=0.6, prior_miss_exponent=1.0)
    assert estimator.acceptance == pytest.approx(0.6)
    assert estimator.miss_exponent == 1.0
    estimator.observe(3, 3, 2, True)  # one observation is not a fit
    assert estimator.miss_exponent == 1.0
