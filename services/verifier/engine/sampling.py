"""The target distribution a request samples from (temperature, then top-k, then top-p), and
the randomness it samples with.

`target_probs` is the one definition of that distribution. The plain (non-speculative) decoder
samples from it and verification (acceptance.py) checks drafts against it, so that speculative
sampling is lossless with respect to exactly what plain sampling would do.

A request's randomness is a function of (seed, position) alone: the token at output position i
is the inverse-CDF draw of the target distribution there with the uniform
`position_uniforms(seed, [i])`. So the token at every position is fixed before any verification,
whatever drafts were offered, and a seeded answer is the same with speculation off, SSSD, prompt
lookup or any other drafting source.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sssd.verifier.engine.request import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15

# The nucleus is searched among the _NUCLEUS_HEAD most likely tokens first, then among
# _NUCLEUS_HEAD_GROWTH times as many, and so on up to a full sort (see _top_p).
_NUCLEUS_HEAD = 256
_NUCLEUS_HEAD_GROWTH = 16


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [num_nodes, vocab_size] float32 from logits [num_nodes, vocab_size].

    Applied in the order of Hugging Face's `generate`: temperature, top-k, top-p, min-p (the
    logits come already adjusted by logits_processing.py).
    - Greedy (temperature 0): a one-hot row on the argmax (the first index among equal maxima,
      as `torch.argmax`), whatever top-k and top-p say.
    - Top-k keeps every token whose logit is >= the k-th largest: tokens tied with the k-th are
      all kept, so more than k can survive (as Hugging Face's TopKLogitsWarper).
    - Top-p (nucleus) keeps the smallest set of most likely tokens whose mass is >= top_p, at
      least one token. Tokens tied in probability with the last one needed are all kept, so the
      kept set does not depend on how the sort orders equal values (it can exceed the minimal
      set). The cumulative mass is summed in float64; rows are renormalized after filtering.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_nodes, vocab_size], got shape {tuple(logits.shape)}")
    logits = logits.float()  # [num_nodes, vocab_size]
    if params.is_greedy:
        probs = torch.zeros_like(logits)  # [num_nodes, vocab_size]
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    scaled = logits / params.temperature  # [num_nodes, vocab_size]
    vocab_size = scaled.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # [num_nodes, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [num_nodes, vocab_size]
    if params.top_p < 1:
        probs = _top_p(probs, params.top_p, params.top_k)
    if params.min_p > 0:
        # min-p (Nguyen et al., 2024): a floor relative to the most likely token, so the cut
        # follows the model's confidence; the most likely token always survives.
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values  # [num_nodes, 1]
        probs = probs * (probs >= floor)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_p(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Nucleus filter of `probs` [num_nodes, vocab_size] float32, renormalized."""
    vocab_size = probs.shape[-1]
    # Only the head of the sorted distribution decides the nucleus, and a full sort of a 50k
    # vocabulary costs ~20x a top-k of a few hundred on CPU: sort a head that holds the nucleus
    # of every row, growing it as needed. After top-k, everything past the k survivors (and
    # their ties) is zero, so the k survivors always hold it.
    is_top_k = 0 < top_k < vocab_size
    head = top_k if is_top_k else _NUCLEUS_HEAD
    while True:
        if head >= vocab_size:
            sorted_probs = probs.sort(dim=-1, descending=True).values  # [num_nodes, vocab_size]
            break
        sorted_probs = torch.topk(probs, head, dim=-1).values  # [num_nodes, num_sorted]
        if is_top_k or bool((sorted_probs.double().sum(dim=-1) >= top_p).all()):
            break
        head *= _NUCLEUS_HEAD_GROWTH
    cumulative = sorted_probs.double().cumsum(dim=-1)  # [num_nodes, num_sorted]
    mass_before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))  # [num_nodes, num_sorted]
    # Position i is needed while the mass before it is still short of top_p; position 0 always.
    num_needed = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)  # [num_nodes, 1]
    threshold = sorted_probs.gather(-1, num_needed - 1)  # [num_nodes, 1]
    kept = probs * (probs >= threshold)  # [num_nodes, vocab_size]
    return kept / kept.sum(dim=-1, keepdim=True)


def _mix64(value: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters nearby inputs."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def position_uniforms(seed: int, positions: Sequence[int]) -> torch.Tensor:
    """[len(positions)] float64 uniforms in [0, 1), one per output position, a function of
    (seed, position) alone (a counter-based generator: splitmix64 of the seed's hash plus
    the position times the golden-ratio increment, 53 bits kept)."""
    base = _mix64(seed & _MASK64)
    return torch.tensor([(_mix64((base + (position + 1) * _GOLDEN64) & _MASK64) >> 11) * 2.0**-53
                         for position in positions], dtype=torch.float64)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [num_rows, vocab_size]: [num_rows] int64, with uniforms
    from `generator`; see `sample_with_uniforms`."""
    uniforms = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device,
                          generator=generator)  # [num_rows]
    return sample_with_uniforms(probs, uniforms)


def sample_with_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [num_rows, vocab_size] given uniforms [num_rows] in [0, 1):
    [num_rows] int64.

    Rows are non-negative weights with a positive sum (they need not sum to 1). Inverse-CDF
    sampling on the float64 cumulative mass: exact up to float64 rounding, tokens of zero mass
    are never drawn, and on CPU it is about 20x faster than torch.multinomial at vocab 50k.
    """
    cumulative = probs.double().cumsum(dim=-1)  # [num_rows, vocab_size]
    total = cumulative[:, -1:]  # [num_rows, 1]
    # [num_rows, 1]; queued to a GPU without waiting for it (the host values are copied out
    # before the call returns)
    uniforms = uniforms.to(torch.float64).reshape(-1, 1).to(probs.device, non_blocking=True)
    # right=True: the first token whose cumulative mass exceeds u, never one of zero mass.
    tokens = torch.searchsorted(cumulative, uniforms * total, right=True)  # [num_rows, 1]
    # u * total can round up to total itself: stay on the last token with mass.
    last_with_mass = (cumulative < total).sum(dim=-1, keepdim=True)  # [num_rows, 1]
    return torch.minimum(tokens, last_with_mass).squeeze(-1)
