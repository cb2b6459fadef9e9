"""EngineStats: what the benchmarks read off an engine's steps."""

import pytest

from sssd.verifier.engine.output import EngineStats, RowOutput, StepOutput


def verified(budget: int, verify_s: float, accepted: int) -> StepOutput:
    row = RowOutput("r", [1] * (accepted + 1), "", accepted, budget, is_verified=True)
    return StepOutput([row], [], num_verified=1, budget=budget, verify_s=verify_s)


def test_steps_are_counted_and_timed_per_budget():
    stats = EngineStats()
    for step in (verified(2, 0.16, 1), verified(4, 0.21, 0), verified(2, 0.18, 0),
                 StepOutput([], [], prefill_s=0.5)):  # admissions only: no verification step
        stats.add(step)
    assert stats.num_steps == 3 and stats.budget_counts == {2: 2, 4: 1}
    assert stats.verify_s_by_budget == pytest.approx({2: 0.34, 4: 0.21})
    assert sum(stats.verify_s_by_budget.values()) == pytest.approx(stats.verify_s)
    assert stats.num_accepted == 1 and stats.mean_accepted_per_step == pytest.approx(4 / 3)
    assert stats.prefill_s == 0.5
