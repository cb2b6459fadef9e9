"""The round protocol's types (proto/sssd/v1/speculator.proto), shared by the speculator and its
clients. Free of torch and grpc: the verifier's client imports it without the draft model's
stack."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class FingerprintMismatch(ValueError):
    """The caller's tokenizer is not the draft model's."""


@dataclass(frozen=True)
class RoundInput:
    """One sequence of a round (SequenceRound in speculator.proto)."""

    seq_id: str
    token_ids: Sequence[int]
    num_accepted: int = 0
    budget: int = 1  # draft-tree nodes, root included: budget - 1 drafts at most (0, 1: none)
    is_start: bool = False
    temperature: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class RoundOutput:
    hit: bool
    fallback: bool
    token_ids: list[int]  # [num_drafts]
    probs: list[float]  # [num_drafts]
