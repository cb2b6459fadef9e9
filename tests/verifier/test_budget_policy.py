"""Speculation-budget policies: the paper's rule and the measured-cost optimizer."""

import numpy as np
import pytest

from sssd.verifier.budget_policy import FixedBudget, ForwardProfile, MeasuredBudget, RuleBudget


def flat_then_linear_profile():
    # t(b, s): flat up to b * s = 16, then linear, like a roofline knee (seconds).
    batches, budgets = [1, 2, 4, 8], [1, 2, 4, 8, 16, 32]
    seconds = np.array([[0.04 * max(1.0, b * s / 16) for s in budgets] for b in batches])
    return ForwardProfile(batches, budgets, seconds)


def test_rule_is_knee_over_batch_size():
    policy = RuleBudget(knee_intensity=16.0, max_budget=32)
    assert [policy.budget(b) for b in (1, 2, 4, 8, 32)] == [16, 8, 4, 2, 1]
    assert FixedBudget(1).budget(7) == 1


def test_measured_policy_follows_observed_acceptance():
    policy = MeasuredBudget(flat_then_linear_profile(), max_budget=32)
    # Optimistic start: untried budgets look good, so the largest free one is tried first.
    assert policy.budget(1) == 16
    # Nothing is ever accepted: every budget but 1 decays toward zero gain and s_q = 1 wins.
    for _ in range(400):
        s = policy.budget(1)
        policy.observe(1, s, [0], 0.04)
    assert policy.budget(1) == 1


def test_measured_policy_spends_more_when_drafts_are_good():
    policy = MeasuredBudget(flat_then_linear_profile(), max_budget=32)
    for _ in range(300):
        s = policy.budget(1)
        # Acceptance grows with the budget, saturating: log2(s) accepted tokens.
        policy.observe(1, s, [int(np.log2(s))], 0.04)
    assert policy.budget(1) == 16  # free at b = 1 and the most accepted
    assert policy.budget(8) <= 2  # at b = 8 anything beyond 2 costs more than it gains


def test_profile_round_trip(tmp_path):
    profile = flat_then_linear_profile()
    profile.save(tmp_path / "profile.json")
    loaded = ForwardProfile.load(tmp_path / "profile.json")
    assert loaded.batches == profile.batches and loaded.budgets == profile.budgets
    np.testing.assert_allclose(loaded.seconds, profile.seconds)
    assert loaded.time(3, 0) == pytest.approx(0.04)


def test_measured_policy_needs_a_candidate():
    with pytest.raises(ValueError, match="max_budget"):
        MeasuredBudget(ForwardProfile([1], [8], np.array([[0.1]])), max_budget=4)
