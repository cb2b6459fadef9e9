"""Saguaro sampling (docs/services/speculator.md): the draft distribution the speculator samples.

With S the top-F tokens of the draft distribution q, drafts are sampled from
q'(v) = C q(v) / Z for v in S and q(v) / Z otherwise, Z = 1 - (1 - C) sum_{v in S} q(v). Making
the draft avoid its own top tokens makes a rejection's bonus token likelier to land in S, the
set the speculation cache predicted. A verifier that uses the draft distribution must be given
q', not q (tests/verifier/engine/test_acceptance.py shows q fails the chi-square test).
"""

from __future__ import annotations

import torch


def saguaro_probs(probs: torch.Tensor, top_f: int, c: float) -> torch.Tensor:
    """q' from q = `probs` [..., vocab_size] (rows sum to 1): the `top_f` most likely tokens of
    each row get their probability scaled by `c` in (0, 1], then every row is renormalised."""
    if not 0 < c <= 1:
        raise ValueError(f"c must be in (0, 1], got {c}")
    if top_f <= 0 or c == 1:
        return probs
    top = torch.topk(probs, min(top_f, probs.shape[-1]), dim=-1).indices
    scale = torch.ones_like(probs).scatter_(-1, top, c)
    scaled = probs * scale
    return scaled / scaled.sum(dim=-1, keepdim=True)
