"""`Totals`: what a finished request reports, the same type on the server and in the client.

Kept apart from the engine (torch) and the gRPC code, so both sides import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Totals:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_s: float
    total_s: float
    tokens_per_second: float
    mean_accepted_length: float  # tokens per verification step (accepted + 1)
    finish_reason: str  # "stop", "length" or "cancelled"
    cached_tokens: int = 0  # leading prompt tokens taken from the prefix cache
