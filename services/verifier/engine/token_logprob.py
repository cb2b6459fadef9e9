"""`TokenLogprob`: what the engine reports of one emitted token's log-probability. Torch-free,
so the serving layer (HTTP and gRPC frontends, the Ray backend) carries it without the model's
stack; logits_processing.token_logprobs computes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # [num_top] (token id, logprob), most likely first
