"""Tests of sssd.verifier.engine.sampling: the target distribution (temperature, top-k, top-p),
sampling.

Expected distributions are computed by hand from logits = log(probabilities), so that softmax
returns the probabilities themselves; values stay away from the top-p boundary except where a
test is about the boundary (ties).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sssd.verifier.engine.request import SamplingParams
from sssd.verifier.engine.sampling import (
    position_uniforms,
    sample_tokens,
    sample_with_uniforms,
    target_probs,
)


def logits_of(*probs: float) -> torch.Tensor:
    """[1, vocab_size] logits whose softmax is `probs`."""
    return torch.tensor([probs], dtype=torch.float64).log().float()


def assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.tensor([expected], dtype=torch.float32),
                               atol=1e-6, rtol=1e-5)


def reference_target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Plain per-row reference of the documented rule (full sort, ties kept), in float64."""
    rows = []
    for row in logits.double().numpy():
        scaled = row / params.temperature  # [vocab_size]
        if 0 < params.top_k < scaled.shape[0]:
            kth = np.sort(scaled)[::-1][params.top_k - 1]
            scaled = np.where(scaled >= kth, scaled, -np.inf)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if params.top_p < 1:
            descending = np.sort(probs)[::-1]
            num_needed = 1
            while num_needed < descending.shape[0] and descending[:num_needed].sum() < params.top_p:
                num_needed += 1
            probs = np.where(probs >= descending[num_needed - 1], probs, 0.0)
            probs /= probs.sum()
        rows.append(probs)
    return torch.tensor(np.stack(rows))


# --- temperature ---------------------------------------------------------------------------------


def test_temperature_one_is_softmax():
    assert_probs(target_probs(logits_of(1, 2, 4), SamplingParams(temperature=1.0)),
                 [1 / 7, 2 / 7, 4 / 7])


def test_low_temperature_sharpens():
    # p^(1/0.5) = p^2: (1, 4, 16) / 21
    assert_probs(target_probs(logits_of(1, 2, 4), SamplingParams(temperature=0.5)),
                 [1 / 21, 4 / 21, 16 / 21])


def test_high_temperature_flattens():
    # p^(1/2) = sqrt(p): (1, sqrt 2, 2) / (3 + sqrt 2)
    total = 3 + math.sqrt(2)
    assert_probs(target_probs(logits_of(1, 2, 4), SamplingParams(temperature=2.0)),
                 [1 / total, math.sqrt(2) / total, 2 / total])


def test_greedy_is_one_hot_on_first_argmax_and_ignores_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 0.0, 2.0]])
    params = SamplingParams(temperature=0.0, top_k=2, top_p=0.5)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(target_probs(logits, params), expected)


# --- top-k ---------------------------------------------------------------------------------------


def test_top_k_keeps_k_most_likely():
    assert_probs(target_probs(logits_of(0.1, 0.2, 0.3, 0.4), SamplingParams(1.0, top_k=2)),
                 [0, 0, 3 / 7, 4 / 7])


def test_top_k_keeps_tokens_tied_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    expected = torch.softmax(torch.tensor([3.0, 1.0, 1.0]), -1).tolist() + [0.0]
    assert_probs(target_probs(logits, SamplingParams(1.0, top_k=2)), expected)


def test_top_k_at_or_above_vocab_size_is_off():
    for top_k in (4, 100):
        assert_probs(target_probs(logits_of(0.1, 0.2, 0.3, 0.4), SamplingParams(1.0, top_k=top_k)),
                     [0.1, 0.2, 0.3, 0.4])


# --- top-p ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (1.0, [0.1, 0.2, 0.3, 0.4]),  # off
        (0.95, [0.1, 0.2, 0.3, 0.4]),  # needs all four: 0.9 < 0.95
        (0.8, [0, 2 / 9, 3 / 9, 4 / 9]),  # 0.4 + 0.3 + 0.2 = 0.9 >= 0.8
        (0.5, [0, 0, 3 / 7, 4 / 7]),  # 0.4 < 0.5, 0.4 + 0.3 >= 0.5
        (0.35, [0, 0, 0, 1]),  # 0.4 alone reaches it
        (1e-9, [0, 0, 0, 1]),  # at least one token
    ],
)
def test_top_p_keeps_smallest_set_reaching_the_mass(top_p, expected):
    assert_probs(target_probs(logits_of(0.1, 0.2, 0.3, 0.4), SamplingParams(1.0, top_p=top_p)),
                 expected)


def test_top_p_keeps_every_token_tied_with_the_last_one_needed():
    # The minimal set for 0.5 is {0.4, one of the 0.2s}; the tie rule keeps all three 0.2s.
    assert_probs(target_probs(logits_of(0.2, 0.4, 0.2, 0.2), SamplingParams(1.0, top_p=0.5)),
                 [0.2, 0.4, 0.2, 0.2])
    assert_probs(target_probs(logits_of(0.2, 0.4, 0.2, 0.2), SamplingParams(1.0, top_p=0.3)),
                 [0, 1, 0, 0])


def test_order_is_temperature_then_top_k_then_top_p():
    # T = 0.5: p^2 = (1, 4, 9, 16) / 30; top-k 3: (4, 9, 16) / 29; top-p 0.6: 16/29 = 0.55 < 0.6,
    # so (9, 16) / 25.
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.6)
    assert_probs(target_probs(logits_of(0.1, 0.2, 0.3, 0.4), params), [0, 0, 9 / 25, 16 / 25])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(1.0, top_p=0.9),
        SamplingParams(1.0, top_p=0.999),  # nucleus wider than the sorted head: full sort
        SamplingParams(0.7, top_k=40, top_p=0.8),
        SamplingParams(1.3, top_k=300, top_p=0.95),
        SamplingParams(0.5, top_k=7),
    ],
)
@pytest.mark.parametrize("logit_scale", [0.5, 4.0])
def test_matches_full_sort_reference_with_ties(params, logit_scale):
    generator = torch.Generator().manual_seed(7)
    # Rounded logits make many exact ties, also at the top-k and top-p boundaries.
    logits = (torch.randn(6, 1000, generator=generator) * logit_scale * 4).round() / 4
    actual = target_probs(logits, params)
    torch.testing.assert_close(actual.double(), reference_target_probs(logits, params),
                               atol=1e-6, rtol=1e-4)
    assert ((actual > 0) == (reference_target_probs(logits, params) > 0)).all()


@pytest.mark.parametrize("num_likely", [200, 300, 5000])
def test_nucleus_wider_than_the_first_sorted_head(num_likely):
    # num_likely tokens share most of the mass: the nucleus of 0.9 spans more than the first
    # 256 sorted tokens for 300 (search grows to 4096) and for 5000 (full sort).
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 10000, generator=generator) * 0.1
    logits[:, :num_likely] += 8.0
    params = SamplingParams(1.0, top_p=0.9)
    actual = target_probs(logits, params)
    torch.testing.assert_close(actual.double(), reference_target_probs(logits, params),
                               atol=1e-7, rtol=1e-4)


def test_rows_sum_to_one_and_low_precision_input_is_accepted():
    logits = torch.randn(5, 300, dtype=torch.bfloat16)
    probs = target_probs(logits, SamplingParams(0.8, top_k=50, top_p=0.9))
    assert probs.shape == (5, 300) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_logits_must_be_two_dimensional():
    with pytest.raises(ValueError, match="num_nodes, vocab_size"):
        target_probs(torch.zeros(4), SamplingParams(1.0))


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -3}, "seed"),
        ({"seed": "7"}, "seed"),
    ],
)
def test_invalid_params_raise_with_the_field_and_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_are_greedy_and_params_are_frozen():
    params = SamplingParams()
    assert params.is_greedy and params.top_p == 1.0 and params.top_k == 0 and params.seed is None
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]


# --- sampling ------------------------------------------------------------------------------------


def test_position_uniforms_are_a_function_of_seed_and_position():
    probs = target_probs(torch.randn(3, 50), SamplingParams(1.0))
    first = position_uniforms(123, [0, 1, 2])
    torch.testing.assert_close(first, position_uniforms(123, [0, 1, 2]))
    torch.testing.assert_close(position_uniforms(123, [2]), first[2:])  # order-free
    assert not torch.equal(first, position_uniforms(124, [0, 1, 2]))
    assert len(set(first.tolist())) == 3 and bool(((first >= 0) & (first < 1)).all())
    torch.testing.assert_close(sample_with_uniforms(probs, first),
                               sample_with_uniforms(probs, position_uniforms(123, [0, 1, 2])))


def test_position_uniforms_are_uniform_and_independent():
    # 20000 (seed, position) pairs: the mean and the lag-1 correlation of a U(0, 1) sample,
    # and the fraction in each tenth, within four standard errors.
    values = torch.cat([position_uniforms(seed, range(20)) for seed in range(1000)]).numpy()
    assert abs(values.mean() - 0.5) < 4 * (1 / 12 / values.size) ** 0.5
    pairs = values.reshape(1000, 20)
    correlation = np.corrcoef(pairs[:, :-1].ravel(), pairs[:, 1:].ravel())[0, 1]
    assert abs(correlation) < 4 / pairs[:, 1:].size ** 0.5
    tenths = np.bincount((values * 10).astype(int), minlength=10) / values.size
    assert np.all(np.abs(tenths - 0.1) < 4 * (0.09 / values.size) ** 0.5)


def test_sample_tokens_follows_weights_and_never_draws_zero_mass():
    # Unnormalized weights, zero mass at both ends and in the middle.
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0]]).expand(40000, -1)
    tokens = sample_tokens(weights, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6).double() / tokens.shape[0]
    assert counts[[0, 2, 5]].sum() == 0
    # Three standard deviations of a frequency over 40000 draws are below 0.0075.
    torch.testing.assert_close(counts, torch.tensor([0, 0.5, 0, 0.25, 0.25, 0],
                                                    dtype=torch.float64), atol=0.0075, rtol=0)
