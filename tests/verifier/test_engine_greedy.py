"""Greedy exactness: speculative output equals transformers' generate(), token for token.

float32 so that numerical near-ties cannot hide a bug (DESIGN.md section 5).
"""

import pytest


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("datastore", ["empty", "warm"])
def test_sssd_greedy_equals_generate(engine_factory, mt_bench_prompts, greedy_references,
                                     warm_datastore, batch_size, datastore):
    engine, drafter = engine_factory(batch_size, warm_datastore if datastore == "warm" else None)
    try:
        # Mixed prompt lengths share every batch: requests join and leave between steps.
        outputs = engine.generate(mt_bench_prompts, max_tokens=64)
    finally:
        drafter.close()
    for index, (output, reference) in enumerate(zip(outputs, greedy_references)):
        assert output == reference, f"prompt {index} differs"
    # Speculation must actually happen, or the test proves nothing about tree verification.
    assert engine.stats.num_accepted > 0
    if datastore == "warm":
        assert engine.stats.mean_accepted_per_step > 1.5


def test_autoregressive_mode_equals_generate(engine_factory, mt_bench_prompts, greedy_references):
    engine, _ = engine_factory(4, proposer=None)
    outputs = engine.generate(mt_bench_prompts[:6], max_tokens=64)
    assert outputs == greedy_references[:6]
    assert engine.stats.num_accepted == 0
