"""bench/policy_engine.py: the steps of a configuration are priced from the cost tables, and the
policy is told those prices as its timed steps' times."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bench.policy_engine import PricedRun, after_warm_up, step_noise
from sssd.verifier.engine.budget_policy import FixedBudget, MeasuredBudget
from sssd.verifier.engine.forward_profile import DEFAULT_BUDGETS, ForwardProfile

COSTS = {1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0, 16: 18.0, 32: 30.0}
DRAIN = {1: 5.0, 2: 6.0, 4: 7.0, 8: 8.0, 16: 9.0, 32: 10.0}


class Recorder:
    def __init__(self) -> None:
        self.calls = []

    def observe(self, batch_size, budget, accepted_nodes, step_s, rows=None):
        self.calls.append((batch_size, budget, step_s))


def test_steps_are_priced_by_budget_and_rows_and_the_policy_is_told_the_price():
    policy = Recorder()
    run = SimpleNamespace(engine=SimpleNamespace(budget_policy=policy))
    priced = PricedRun(run, COSTS, DRAIN, drain_rows=3)
    observe = run.engine.budget_policy.observe
    observe(4, 8, [[1]] * 4, 0.5, ["a", "b", "c", "d"])  # a full step, timed at 0.5 s
    observe(4, 16, [[1]] * 4, None, ["a", "b", "c", "d"])  # a hindsight step: untimed
    observe(2, 8, [[1]] * 2, 0.25, ["a", "b"])  # a draining step
    assert policy.calls == [(4, 8, pytest.approx(0.014)), (4, 16, None),
                            (2, 8, pytest.approx(0.008))]
    # every step is priced, timed or not
    assert priced.seconds == pytest.approx((14.0 + 18.0 + 8.0) / 1e3)
    assert priced.real_seconds == {8: [0.5, 0.25]}  # what the timed steps really took
    assert priced.steps == {8: 2, 16: 1}


def test_the_measured_policy_forgets_the_warm_up_and_a_fixed_one_is_kept():
    profile = ForwardProfile([1], DEFAULT_BUDGETS, np.array([[0.02] * len(DEFAULT_BUDGETS)]))
    warmed = MeasuredBudget(profile, max_budget=16)
    for _ in range(4):  # the warm-up's steps, timed for real
        warmed.observe(1, 16, [[1, 2]], 0.09)
    assert warmed.observed_seconds
    fresh = after_warm_up(warmed, row_decay=0.1)
    assert isinstance(fresh, MeasuredBudget) and fresh is not warmed
    assert fresh.observed_seconds == {} and fresh.row_decay == 0.1
    assert fresh.expected_accepted[16] == pytest.approx(1.3)  # the prior, not the warm-up
    assert fresh.profile is profile and [s for _, s in fresh.candidates] == [1, 2, 4, 8, 16]
    fixed = FixedBudget(8)
    assert after_warm_up(fixed, row_decay=None) is fixed


def noisy_run(seed, noise, block=1, steps=32):
    policy = Recorder()
    priced = PricedRun(SimpleNamespace(engine=SimpleNamespace(budget_policy=policy)), COSTS,
                       DRAIN, drain_rows=1, noise_ms=noise, seed=seed, noise_block=block)
    for budget in ((8, 16, 8, 8, 16, 4, 8, 16) * steps)[:steps]:
        policy.observe(1, budget, [[1]], 0.1)
    excess = [round(1e3 * step_s - COSTS[b], 9) for _, b, step_s in policy.calls]
    return priced, [step_s for _, _, step_s in policy.calls], excess


def test_noise_is_drawn_per_step_the_same_for_every_configuration_of_an_order():
    noise = [np.array([-1.0, 0.0, 4.0]), np.array([40.0])]
    priced, told, excess = noisy_run(0, noise)
    assert set(excess) == {-1.0, 0.0, 4.0, 40.0}  # each a draw of the noise
    assert priced.seconds == pytest.approx(sum(told))  # the policy is told what is charged
    assert noisy_run(0, noise)[1] == told and noisy_run(1, noise)[1] != told


def test_noise_blocks_are_runs_of_consecutive_recorded_steps():
    sequence = np.arange(1000.0)  # recorded excess 0, 1, 2, ... ms, in the order they ran

    def breaks(block):  # steps whose excess does not follow the step before's in the recording
        excess = noisy_run(3, [sequence], block=block, steps=64)[2]
        return sum(b - a != 1 for a, b in zip(excess, excess[1:]))

    assert 4 <= breaks(8) <= 8  # runs of 8 (63 pairs: 7 run boundaries), drawn anywhere
    assert breaks(1) >= 60  # single steps: almost never two in recorded order


def test_step_noise_is_the_excess_over_each_budget_median(tmp_path):
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"code/0": {"fixed:8": {"8": [0.020] * 15 + [0.021] * 4 + [0.05]},
                                           "measured": {"4": [0.1] * 5}}}))  # too few: left out
    noise = step_noise(path)
    assert len(noise) == 1
    assert list(np.round(noise[0], 6)) == [0.0] * 15 + [1.0] * 4 + [30.0]  # in recorded order
    path.write_text(json.dumps({"code/0": {"fixed:8": {"8": [0.02] * 5}}}))
    with pytest.raises(SystemExit, match="no budget with 20"):
        step_noise(path)
    path.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a --record-steps file"):
        step_noise(path)
