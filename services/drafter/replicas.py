"""Sticky routing across drafter replicas: one `Proposer` over several `sssd-drafter` processes.

A drafter keeps per-sequence state (the input trie, the match positions), so every call for a
sequence must reach the replica that holds it. `ReplicatedDrafter` resolves the replicas (a
static list, or every address of a DNS name: a Kubernetes headless Service), gives each new
sequence to its rendezvous-hashing owner (the replica with the highest hash of (replica,
seq_id)), and keeps a sequence on its replica while that replica lives. Rendezvous hashing moves
only the sequences of a replica that leaves, and a new replica takes only new sequences.

When a replica disappears (it left the DNS answer, or a call to it failed to connect) its
sequences move through the drafting interface's re-send path: the call raises
`SequenceNotFound` for them, the engine re-sends their full contexts with `is_start`, and they
start on their new owners. A failed replica is skipped for `down_s` seconds and taken back only
once the standard gRPC health check says it serves.

Targets (`sssd.common.rpc.targets.parse_targets`): "host:port" (one replica), "h1:p1,h2:p2,..."
(a static list), or "dns:///name:port" (re-resolved every `resolve_interval_s`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sssd.common.drafting.batch_split import Split, propose_split, raise_failure
from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest, Proposer, SequenceNotFound
from sssd.common.rpc import tls
from sssd.common.rpc.targets import Resolver, StaticResolver, parse_targets, rendezvous_owner
from sssd.drafter.client import RemoteDrafter

logger = logging.getLogger(__name__)


class ReplicatedDrafter:
    """A `Proposer` over drafter replicas with per-sequence stickiness; see the module doc."""

    sources = ("sssd",)
    hindsight_drafts = True  # every replica drafts as the in-process LocalDrafter does

    def __init__(self, resolver: Resolver, timeout_s: float = 1.0,
                 resolve_interval_s: float = 5.0, down_s: float = 5.0,
                 client: Callable[[str, float], Proposer] = RemoteDrafter) -> None:
        if timeout_s <= 0 or resolve_interval_s <= 0 or down_s < 0:
            raise ValueError("timeout_s and resolve_interval_s must be > 0, down_s >= 0")
        self.resolver = resolver
        self.timeout_s = timeout_s
        self.resolve_interval_s = resolve_interval_s
        self.down_s = down_s
        self._client = client
        self._clients: dict[str, Proposer] = {}
        self._owner: dict[str, str] = {}  # seq_id -> the replica holding its state
        self._resolved: list[str] = []
        self._resolved_at = float("-inf")
        self._down: dict[str, float] = {}  # replica -> monotonic time it may be probed again
        self._probes: dict[str, Future] = {}  # replica -> its health check in flight
        self._resolving: Future | None = None  # a resolution in flight
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="drafter-replicas")
        self.num_moved = 0  # sequences moved off a replica that left

    # --- the Proposer protocol ---------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        live = self.live_replicas()
        gone = [r.seq_id for r in requests
                if not r.is_start and self._owner.get(r.seq_id) not in live]
        if gone:  # their replica left (or they were never here): start them on their new owner
            self.num_moved += sum(seq_id in self._owner for seq_id in gone)
            for seq_id in gone:
                self._owner.pop(seq_id, None)
            raise SequenceNotFound(gone)
        if not live:
            raise ConnectionError(f"no drafter replica is reachable (resolved: "
                                  f"{self._resolved or 'none'})")
        targets = [rendezvous_owner(r.seq_id, live) if r.is_start else self._owner[r.seq_id]
                   for r in requests]
        split = propose_split(requests, targets, self._clients.__getitem__, self._pool)
        if split.failures:
            self._mark_unreachable(split, requests)
            # The unreachable replicas' sequences go to their new owners in this same step.
            raise_failure(split, requests, is_lost=lambda exc: isinstance(exc, ConnectionError))
        stale: dict[str, list[str]] = {}  # restarted elsewhere: the old copy is dead weight
        for request, target in zip(requests, targets):
            previous = self._owner.get(request.seq_id)
            if previous is not None and previous != target and previous in live:
                stale.setdefault(previous, []).append(request.seq_id)
            self._owner[request.seq_id] = target
        for replica, ids in stale.items():
            self._end_on(replica, ids)
        return split.trees  # type: ignore[return-value]

    def end(self, seq_ids: Sequence[str]) -> int:
        by_replica: dict[str, list[str]] = {}
        for seq_id in seq_ids:
            owner = self._owner.pop(seq_id, None)
            if owner is not None:
                by_replica.setdefault(owner, []).append(seq_id)
        return sum(self._end_on(replica, ids) for replica, ids in by_replica.items())

    def stats(self) -> dict[str, dict[str, float]]:
        return {}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    # --- replicas ------------------------------------------------------------------------------

    def live_replicas(self) -> list[str]:
        """The resolved replicas not marked down. Re-resolution (every resolve_interval_s) and
        the health checks of down replicas run on the pool, off the decode step; only the first
        resolution is waited for."""
        now = time.monotonic()
        if self._resolving is None and now - self._resolved_at >= self.resolve_interval_s:
            self._resolving = self._pool.submit(self.resolver.resolve)
            if self._resolved_at == float("-inf"):
                wait([self._resolving])
        if self._resolving is not None and self._resolving.done():
            resolving, self._resolving = self._resolving, None
            self._apply_resolution(resolving, now)
        for replica, until in list(self._down.items()):
            probe = self._probes.get(replica)
            if probe is None and now >= until and replica in self._resolved:
                self._probes[replica] = self._pool.submit(self._serving, replica)
            elif probe is not None and probe.done():
                del self._probes[replica]
                if probe.result():
                    del self._down[replica]
                    logger.info("drafter %s is back", replica)
                else:
                    self._down[replica] = now + self.down_s
        return [r for r in self._resolved if r not in self._down]

    def info(self) -> dict[str, Any]:
        return {"replicas": list(self._resolved), "down": sorted(self._down),
                "num_sequences": len(self._owner), "num_moved": self.num_moved}

    def owner_of(self, seq_id: str) -> str | None:
        return self._owner.get(seq_id)

    def _apply_resolution(self, resolving: Future, now: float) -> None:
        self._resolved_at = now
        try:
            resolved = resolving.result()
        except OSError as exc:  # keep the last answer: DNS hiccups must not stop drafting
            logger.warning("resolving the drafter replicas failed (%s); keeping %s", exc,
                           self._resolved)
            return
        if resolved != self._resolved:
            logger.info("drafter replicas: %s", ", ".join(resolved) or "none")
        for replica in set(self._clients) - set(resolved):
            self._clients.pop(replica).close()
            self._down.pop(replica, None)
            self._probes.pop(replica, None)
        for replica in resolved:
            if replica not in self._clients:
                self._clients[replica] = self._client(replica, self.timeout_s)
        self._resolved = resolved

    def _end_on(self, replica: str, seq_ids: list[str]) -> int:
        try:
            return self._clients[replica].end(seq_ids)
        except Exception as exc:  # noqa: BLE001 - a replica that is gone holds nothing
            logger.warning("ending %d sequences on drafter %s failed: %s", len(seq_ids),
                           replica, exc)
            return 0

    def _serving(self, replica: str) -> bool:
        try:
            with tls.channel(replica) as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)
            return answer.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def _mark_unreachable(self, split: Split[str], requests: Sequence[DraftRequest]) -> None:
        """A replica that could not be reached is skipped until its health check serves
        again; its sequences of this call lose their owner (they start on a new one)."""
        for target, exc in split.failures.items():
            if not isinstance(exc, ConnectionError):
                continue
            logger.warning("drafter %s is unreachable (%s): its %d sequences move", target, exc,
                           sum(owner == target for owner in self._owner.values()))
            self._down[target] = time.monotonic() + self.down_s
            for row in split.rows_of[target]:
                self.num_moved += self._owner.pop(requests[row].seq_id, None) is not None


def check_tokenizer(drafter: Any, target: str, fingerprint: str) -> None:
    """ValueError, after closing `drafter`, when the drafter at `target` reports another
    tokenizer than `fingerprint` (its tokens would be another vocabulary's). One that reports
    none passes: a replica set, or a drafter with no datastore yet. A drafter that does not
    answer raises what its `info` raises."""
    theirs = drafter.info().get("tokenizer_fingerprint", "")
    if theirs and theirs != fingerprint:
        drafter.close()
        raise ValueError(f"the drafter at {target} drafts with tokenizer {theirs[:12]}, the "
                         f"model's is {fingerprint[:12]}: refused (start it on a datastore "
                         "built with the model's tokenizer)")


def connect(target: str, timeout_s: float = 1.0) -> Proposer:
    """The drafter client for a target: `RemoteDrafter` for one "host:port", else a
    `ReplicatedDrafter` over the list or the DNS name."""
    resolver = parse_targets(target)
    if isinstance(resolver, StaticResolver) and len(resolver.targets) == 1:
        return RemoteDrafter(resolver.targets[0], timeout_s=timeout_s)
    return ReplicatedDrafter(resolver, timeout_s=timeout_s)
