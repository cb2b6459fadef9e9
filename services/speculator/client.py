"""The speculator as a drafting source of the verifier: `SpeculatorProposer` (a `Proposer`) over a
round backend, the gRPC client `RemoteSpeculator` or an in-process `Speculator`.

The engine hands a proposer the tokens appended since its previous call. After a round that sent
drafts s_1..s_K these are s_1..s_k plus the bonus token, so the proposer turns them into the
round protocol's outcome (k, bonus) itself; the engine knows nothing of SSD.

Misses above the speculator's critical batch size come back marked `fallback`; those sequences
are drafted by the fallback proposer (the SSSD drafter), which the proposer keeps current only
for the sequences it is asked to draft (a full context the first time, new tokens after).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest, Proposer, SequenceNotFound
from sssd.common.rpc import tls
from sssd.common.rpc.status import unary
from sssd.common.rpc.tls import CLIENT_CHANNEL_OPTIONS
from sssd.speculator.protocol import FingerprintMismatch, RoundInput, RoundOutput
from sssd.v1 import speculator_pb2, speculator_pb2_grpc

logger = logging.getLogger(__name__)


class RoundBackend(Protocol):
    def round(self, inputs: Sequence[RoundInput],
              fingerprint: str | None = None) -> list[RoundOutput]: ...

    def end(self, seq_ids: Sequence[str]) -> int: ...


class RemoteSpeculator:
    """A client of one speculator (`sssd-speculator`) at `target` ("host:port"). Errors map as
    in `RemoteDrafter` (sssd.common.rpc.status); FAILED_PRECONDITION becomes
    `FingerprintMismatch`."""

    def __init__(self, target: str, timeout_s: float = 1.0,
                 tls_files: tls.TlsFiles | None = None) -> None:
        """`tls_files`: TLS to the speculator (default: SSSD_TLS_*, sssd.common.rpc.tls)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.target = target
        self.timeout_s = timeout_s
        self._channel = tls.channel(target, tls_files, options=CLIENT_CHANNEL_OPTIONS)
        self._stub = speculator_pb2_grpc.SpeculatorStub(self._channel)

    def round(self, inputs: Sequence[RoundInput],
              fingerprint: str | None = None) -> list[RoundOutput]:
        message = speculator_pb2.RoundRequest(
            sequences=[speculator_pb2.SequenceRound(
                seq_id=i.seq_id, is_start=i.is_start, token_ids=list(i.token_ids),
                num_accepted=i.num_accepted, budget=i.budget, temperature=i.temperature,
                seed=i.seed) for i in inputs],
            tokenizer_fingerprint=fingerprint or "")
        response = self._call(self._stub.Round, message)
        if len(response.sequences) != len(inputs):
            raise RuntimeError(f"speculator at {self.target} answered "
                               f"{len(response.sequences)} sequences for {len(inputs)}")
        return [RoundOutput(s.hit, s.fallback, list(s.token_ids), list(s.probs))
                for s in response.sequences]

    def end(self, seq_ids: Sequence[str]) -> int:
        message = speculator_pb2.EndSpeculationRequest(seq_ids=list(seq_ids))
        return self._call(self._stub.EndSequences, message).num_ended

    def info(self) -> dict[str, Any]:
        info = self._call(self._stub.GetInfo, speculator_pb2.SpeculatorInfoRequest())
        return {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields}

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, message: Any) -> Any:
        return unary(method, message, "speculator", self.target, self.timeout_s,
                     extra=[(grpc.StatusCode.FAILED_PRECONDITION, FingerprintMismatch)])


@dataclass
class _Tracked:
    tokens: list[int]  # the whole context as the engine sent it
    sent: list[int] = field(default_factory=list)  # the speculator's drafts of the last round
    fallback_len: int = 0  # tokens the fallback proposer holds (0: not started there)


@dataclass
class SsdCounters:
    rounds: int = 0
    hits: int = 0
    misses: int = 0
    fallbacks: int = 0
    fallback_errors: int = 0


class SpeculatorProposer:
    """SSD drafting for the engine: one `round` per step, chains of drafts as trees."""

    sources = ("ssd",)
    # Its drafts are a chain drafted for the budget asked; a longer chain is not what a larger
    # budget would have been verified with, so it is not scored in hindsight.
    hindsight_drafts = False

    def __init__(self, backend: RoundBackend, fallback: Proposer | None = None,
                 fingerprint: str | None = None, owns_backend: bool = True) -> None:
        self.backend = backend
        self.fallback = fallback
        self.fingerprint = fingerprint
        self.counters = SsdCounters()
        self._owns_backend = owns_backend
        self._seqs: dict[str, _Tracked] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        unknown = [r.seq_id for r in requests if not r.is_start and r.seq_id not in self._seqs]
        if unknown:
            raise SequenceNotFound(unknown)
        news = [_ints(r.token_ids) for r in requests]
        inputs = [self._round_input(r, new) for r, new in zip(requests, news)]
        outputs = self.backend.round(inputs, self.fingerprint)
        # The round succeeded: only now does the tracked state change (a failed call changes
        # none, so the engine's re-send after an error finds it as it was).
        for request, new, output in zip(requests, news, outputs):
            tracked = self._seqs.get(request.seq_id)
            if request.is_start or tracked is None:
                tracked = self._seqs[request.seq_id] = _Tracked(new)
            else:
                tracked.tokens.extend(new)
            tracked.sent = list(output.token_ids)
        self.counters.rounds += 1
        trees: list[DraftTree | None] = []
        fallback_rows = []
        for row, (request, output) in enumerate(zip(requests, outputs)):
            root = self._seqs[request.seq_id].tokens[-1]
            self.counters.hits += output.hit
            if output.fallback:
                self.counters.fallbacks += 1
                fallback_rows.append(row)
                trees.append(None)
                continue
            self.counters.misses += (not output.hit) and bool(output.token_ids)
            trees.append(_chain(root, output.token_ids, output.probs))
        if fallback_rows:
            fallback_trees = self._fallback([requests[row] for row in fallback_rows])
            for row, tree in zip(fallback_rows, fallback_trees):
                trees[row] = tree
        return trees  # type: ignore[return-value]

    def stats(self) -> dict[str, dict[str, float]]:
        """Rounds, speculation-cache hits, just-in-time misses and SSSD fallbacks, as seen by
        this client (the speculator's own endpoint has the service-wide figures)."""
        return {"ssd": {name: float(value) for name, value in asdict(self.counters).items()}}

    def end(self, seq_ids: Sequence[str]) -> int:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)
        if self.fallback is not None:
            try:
                self.fallback.end(seq_ids)
            except Exception as exc:  # noqa: BLE001 - its state is restarted on next use
                logger.warning("fallback end() failed: %s", exc)
        return self.backend.end(seq_ids)

    def close(self) -> None:
        if self.fallback is not None:
            self.fallback.close()
        if self._owns_backend:
            close = getattr(self.backend, "close", None)
            if close is not None:
                close()

    def _round_input(self, request: DraftRequest, new: list[int]) -> RoundInput:
        tracked = self._seqs.get(request.seq_id)
        common = dict(budget=request.budget, temperature=request.temperature, seed=request.seed)
        if request.is_start or tracked is None:
            return RoundInput(request.seq_id, new, 0, is_start=True, **common)
        sent = tracked.sent
        k = len(new) - 1
        if sent and 0 <= k <= len(sent) and new[:k] == sent[:k]:
            return RoundInput(request.seq_id, new, k, **common)
        if sent:  # not an outcome of the drafts sent (the engine cut the step short): restart
            return RoundInput(request.seq_id, tracked.tokens + new, 0, is_start=True, **common)
        return RoundInput(request.seq_id, new, 0, **common)

    def _fallback(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        roots = [DraftTree.root_only(self._seqs[r.seq_id].tokens[-1]) for r in requests]
        if self.fallback is None:
            return roots
        for attempt in range(2):
            try:
                return self._fallback_propose(requests)
            except SequenceNotFound as missing:  # it lost them: full contexts, once
                for seq_id in missing.seq_ids:
                    self._seqs[seq_id].fallback_len = 0
                if attempt == 0:
                    continue
                logger.warning("fallback drafter lost %s twice; decoding without drafts",
                               missing.seq_ids)
            except Exception as exc:  # noqa: BLE001 - the step goes on without drafts
                logger.warning("fallback drafter failed (%s); decoding without drafts", exc)
            break
        self.counters.fallback_errors += 1
        for r in requests:
            self._seqs[r.seq_id].fallback_len = 0
        return roots

    def _fallback_propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        assert self.fallback is not None
        calls = []
        for r in requests:
            tracked = self._seqs[r.seq_id]
            calls.append(DraftRequest(r.seq_id, tracked.tokens[tracked.fallback_len:], r.budget,
                                      is_start=tracked.fallback_len == 0,
                                      temperature=r.temperature, seed=r.seed))
        trees = self.fallback.propose(calls)
        for r in requests:
            tracked = self._seqs[r.seq_id]
            tracked.fallback_len = len(tracked.tokens)
        return trees


def _ints(token_ids: np.ndarray | Sequence[int]) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, np.ndarray) else [int(t) for t in token_ids]


def _chain(root: int, drafts: Sequence[int], probs: Sequence[float]) -> DraftTree:
    n = len(drafts) + 1
    return DraftTree(
        token_ids=np.array([root, *drafts], dtype=np.int32),
        parents=np.arange(-1, n - 1, dtype=np.int32),
        probs=np.array([1.0, *probs], dtype=np.float32) if len(probs) == len(drafts) else None,
    )
