"""The drafting interface: how every drafting source meets the verifier engine.

In-process SSSD (`sssd.drafter.drafter.LocalDrafter`), the remote drafter service
(`sssd.drafter.client.RemoteDrafter`, `sssd.drafter.replicas.ReplicatedDrafter`), prompt lookup
(a LocalDrafter without a datastore), the SSD speculator
(`sssd.speculator.client.SpeculatorProposer`) and several of them behind one
(`sssd.common.drafting.router.SourceRouter`) implement `Proposer`. The engine makes one
`propose` call per decoding step for its whole batch and knows of the source only what the
protocol declares.

This module imports neither grpc nor the C++ core, so code that only drafts through a remote
service loads neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from sssd.common.drafting.draft_tree import DraftTree


@dataclass(frozen=True)
class DraftRequest:
    """One sequence of a batched call."""

    seq_id: str  # the caller's sequence id, unique among live sequences
    token_ids: np.ndarray | Sequence[int]  # [num_new_tokens]; the full context when is_start
    budget: int  # draft-tree nodes, root included (s_q); 1 means no speculation
    is_start: bool = False  # token_ids is the whole context: (re)start the sequence
    # The sequence's sampling, for sources that draft from a model (the speculator samples its
    # drafts at this temperature); n-gram sources ignore them. Drafts never change the output.
    temperature: float = 0.0
    seed: int = 0
    # The drafting source the request asked for (the API's speculation mode: "sssd", "ssd");
    # "" lets a SourceRouter choose by measured cost. Single sources ignore it.
    source: str = ""


class SequenceNotFound(KeyError):
    """Continuation for sequences the proposer holds no state for: re-send their full context
    with `is_start` (the proposer restarted, evicted them, or another replica held them)."""

    def __init__(self, seq_ids: list[str]) -> None:
        super().__init__(seq_ids)
        self.seq_ids = seq_ids

    def __str__(self) -> str:
        return f"unknown sequence ids (re-send the full context with is_start): {self.seq_ids}"


class CapacityError(RuntimeError):
    """The proposer's table of live sequences is full: end finished sequences first."""


@runtime_checkable
class Proposer(Protocol):
    """A drafting source. Every method takes or returns whole batches.

    Errors: ValueError for a malformed request, SequenceNotFound for continuations of unknown
    sequences (re-send with is_start), CapacityError when too many sequences are live; a call
    that raises changes no state. Remote implementations add TimeoutError and ConnectionError;
    the engine then decodes that step without drafts.
    """

    # The drafting sources behind this proposer, by the API's speculation modes ("sssd",
    # "ssd"): what a request may name in `DraftRequest.source`.
    sources: tuple[str, ...]
    # True when its tree of budget s is the first s nodes of its tree of any larger budget
    # (nodes inserted best-first) and drafting a large tree costs little next to a forward
    # pass: the measured budget policy then sometimes drafts larger trees than it verifies and
    # scores the rest in hindsight (sssd.verifier.engine.hindsight). The n-gram drafters are;
    # the SSD speculator is not.
    hindsight_drafts: bool

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """Appends each request's tokens to its sequence and drafts one tree per request, in
        order; a tree has at most `budget` nodes and its root is the sequence's last token.
        A budget of 1 drafts nothing (the tree is its root alone): the call only appends."""
        ...

    def end(self, seq_ids: Sequence[str]) -> int:
        """Frees the state of finished sequences; unknown ids are ignored. Returns how many
        the proposer held."""
        ...

    def stats(self) -> dict[str, dict[str, float]]:
        """Per source, what it measures or counts for the metrics (the router: tokens per step
        and draft time by source; the SSD client: cache hits, misses, fallbacks); {} when it
        has nothing of its own."""
        ...

    def close(self) -> None:
        """Releases the proposer's resources (threads, connections); idempotent."""
        ...
