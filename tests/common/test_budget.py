import pytest

from sssd.verifier.engine.budget_rule import H100_SXM, Accelerator, speculation_budget


def test_budget_is_knee_over_batch_size_with_caps():
    knee = H100_SXM.knee_intensity  # ~295 FLOP/byte
    assert 290 < knee < 300
    assert speculation_budget(1, knee) == 32  # the paper's cap at b = 1
    assert speculation_budget(16, knee) == 18
    assert speculation_budget(64, knee) == 4
    assert speculation_budget(1024, knee) == 1  # no room left: plain decoding


def test_budget_respects_custom_caps():
    assert speculation_budget(1, 40.0, max_budget=64) == 40
    assert speculation_budget(8, 40.0, min_budget=8) == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0, knee_intensity=10.0), "batch_size"),
        (dict(batch_size=1, knee_intensity=0.0), "knee_intensity"),
        (dict(batch_size=1, knee_intensity=10.0, min_budget=5, max_budget=4), "min_budget"),
    ],
)
def test_budget_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        speculation_budget(**kwargs)


def test_accelerator_rejects_nonpositive_figures():
    with pytest.raises(ValueError):
        Accelerator("x", peak_flops=0.0, memory_bandwidth=1.0)
