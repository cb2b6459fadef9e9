"""Loop observers that are not metrics or sinks: the acceptance statistics saved to disk."""

import numpy as np
import pytest

from sssd.verifier.engine.budget_policy import (
    DEFAULT_ACCEPTANCE_PRIOR,
    ForwardProfile,
    MeasuredBudget,
    load_acceptance,
)
from sssd.verifier.engine.output import StepOutput
from sssd.verifier.serving.observers import SAVE_EVERY, AcceptanceSaver


def flat_then_linear_profile():
    batches, budgets = [1, 2, 4, 8], [1, 2, 4, 8, 16, 32]
    seconds = np.array([[0.04 * max(1.0, b * s / 16) for s in budgets] for b in batches])
    return ForwardProfile(batches, budgets, seconds)


def test_acceptance_statistics_are_saved_and_become_the_next_prior(tmp_path):
    path = tmp_path / "forward.sssd.acceptance.json"
    policy = MeasuredBudget(flat_then_linear_profile(), max_budget=32,
                            prior=DEFAULT_ACCEPTANCE_PRIOR)
    saver = AcceptanceSaver(policy, path)
    step = StepOutput([], [], num_verified=1, budget=32)
    for _ in range(SAVE_EVERY):
        assert not path.exists()  # the policy's steps never write; the saver does
        policy.observe(1, 32, [[1, 3, 7, 15, 31]], 0.04)
        saver.on_step(step, 0.04)
    saved = load_acceptance(path)
    assert saved == pytest.approx({s: v for s, v in policy.expected_accepted.items()})
    assert saved[32] > 4 > DEFAULT_ACCEPTANCE_PRIOR[32]
    assert load_acceptance(tmp_path / "missing.json") is None
    policy.observe(1, 32, [[1]], 0.04)
    saver.close()  # the loop stopped: the latest estimates are saved too
    assert load_acceptance(path)[32] == pytest.approx(policy.expected_accepted[32])
