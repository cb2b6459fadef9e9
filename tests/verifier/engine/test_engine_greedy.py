"""Greedy exactness: speculative output equals transformers' generate(), token for token, with
the verifier's own forward pass (the default) and with the transformers forward.

float32 so that numerical near-ties cannot hide a bug.
"""

import numpy as np
import pytest

from sssd.verifier.engine.budget_policy import MeasuredBudget
from sssd.verifier.engine.forward_profile import ForwardProfile


def measured_policy():
    # A made-up profile, flat up to 64 nodes per step: the policy moves between budgets from
    # step to step (exploration included), which exactness must not notice.
    batches, budgets = [1, 2, 4, 8], [1, 2, 4, 8, 16, 32]
    seconds = np.array([[0.04 * max(1.0, b * s / 64) for s in budgets] for b in batches])
    return MeasuredBudget(ForwardProfile(batches, budgets, seconds), max_budget=32)


# Batch 1 runs a prompt at a time, so fewer prompts cover it (CI time); every prompt of the
# session's set runs in the batched cases, where requests of mixed lengths join and leave.
@pytest.mark.parametrize("batch_size,datastore,policy,num_prompts,model_impl", [
    (1, "empty", "rule", 4, "sssd"), (1, "warm", "rule", 6, "sssd"),
    (4, "empty", "rule", 8, "sssd"), (4, "warm", "measured", 8, "sssd"),
    (4, "warm", "rule", 8, "transformers")])
def test_sssd_greedy_equals_generate(engine_factory, mt_bench_prompts, greedy_references,
                                     warm_datastore, batch_size, datastore, policy, num_prompts,
                                     model_impl):
    engine, drafter = engine_factory(batch_size, warm_datastore if datastore == "warm" else None,
                                     model_impl=model_impl)
    assert engine.runner.impl == model_impl
    if policy == "measured":
        engine.budget_policy = measured_policy()
    try:
        outputs = engine.generate(mt_bench_prompts[:num_prompts], max_tokens=64)
    finally:
        drafter.close()
    assert len(outputs) == num_prompts
    for index, (output, reference) in enumerate(zip(outputs, greedy_references)):
        assert output == reference, f"prompt {index} differs"
    # Speculation must actually happen, or the test proves nothing about tree verification.
    assert engine.stats.num_accepted > 0
    if datastore == "warm":
        assert engine.stats.mean_accepted_per_step > 1.5
    if policy == "measured":
        assert len(engine.stats.budget_counts) >= 2  # the budget did change between steps


@pytest.mark.parametrize("model_impl", ["sssd", "transformers"])
def test_autoregressive_mode_equals_generate(engine_factory, mt_bench_prompts, greedy_references,
                                             model_impl):
    engine, _ = engine_factory(4, proposer=None, model_impl=model_impl)
    assert engine.runner.impl == model_impl
    outputs = engine.generate(mt_bench_prompts[:6], max_tokens=64)
    assert outputs == greedy_references[:6]
    assert engine.stats.num_accepted == 0
