"""bench/policy_engine.py: the steps of a configuration are priced from the cost tables, and the
policy is told those prices as its timed steps' times."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from policy_engine import PricedRun  # noqa: E402

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
    assert priced.priced_seconds() == pytest.approx((14.0 + 18.0 + 8.0) / 1e3)
