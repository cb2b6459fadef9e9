"""`RemoteDrafter`: the drafting interface (`Proposer`, sssd.common.drafting.proposer) over gRPC.

It behaves like the in-process `LocalDrafter`, exceptions included, so a decode worker can use
either:
NOT_FOUND becomes `SequenceNotFound` (with the unknown ids), INVALID_ARGUMENT `ValueError`,
RESOURCE_EXHAUSTED `CapacityError`. Transport failures become `TimeoutError` (deadline) or
`ConnectionError` (drafter unreachable); callers then decode that step without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest
from sssd.common.rpc import tls
from sssd.common.rpc.status import unary
from sssd.common.rpc.tls import CLIENT_CHANNEL_OPTIONS
from sssd.v1 import drafter_pb2, drafter_pb2_grpc


def _to_proto(request: DraftRequest) -> drafter_pb2.SequenceDraftRequest:
    token_ids = request.token_ids
    return drafter_pb2.SequenceDraftRequest(
        seq_id=request.seq_id,
        new_token_ids=token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids,
        budget=request.budget,
        is_start=request.is_start,
    )


def _from_proto(tree: drafter_pb2.DraftTree) -> DraftTree:
    # np.asarray converts upb's repeated fields in bulk; tolist() is the fast way back.
    return DraftTree(
        token_ids=np.asarray(tree.token_ids, dtype=np.int32),  # [num_nodes]
        parents=np.asarray(tree.parents, dtype=np.int32),  # [num_nodes]
        probs=np.asarray(tree.probs, dtype=np.float32) if tree.probs else None,  # [num_nodes]
    )


class RemoteDrafter:
    """A client of one drafter replica (`sssd-drafter`) at `target` ("host:port")."""

    sources = ("sssd",)
    hindsight_drafts = True  # the service drafts as the in-process LocalDrafter does

    def __init__(self, target: str, timeout_s: float = 1.0,
                 tls_files: tls.TlsFiles | None = None) -> None:
        """`tls_files`: TLS to the drafter (default: SSSD_TLS_*, see sssd.common.rpc.tls)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.target = target
        self.timeout_s = timeout_s
        self._channel = tls.channel(target, tls_files, options=CLIENT_CHANNEL_OPTIONS)
        self._stub = drafter_pb2_grpc.DrafterStub(self._channel)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftTree]:
        """One draft tree per request, in order; see `LocalDrafter.propose`."""
        message = drafter_pb2.ProposeRequest(sequences=[_to_proto(r) for r in requests])
        response = self._call(self._stub.Propose, message)
        if len(response.drafts) != len(requests):
            raise RuntimeError(
                f"drafter at {self.target} answered {len(response.drafts)} trees "
                f"for {len(requests)} sequences"
            )
        return [_from_proto(tree) for tree in response.drafts]

    def end(self, seq_ids: Sequence[str]) -> int:
        """Frees the state of these sequences; returns how many the drafter held."""
        message = drafter_pb2.EndSequencesRequest(seq_ids=list(seq_ids))
        return self._call(self._stub.EndSequences, message).num_ended

    def info(self) -> dict[str, Any]:
        """The GetInfo fields (drafter.proto, DrafterInfo) as a dict."""
        info = self._call(self._stub.GetInfo, drafter_pb2.GetInfoRequest())
        return {field.name: getattr(info, field.name) for field in info.DESCRIPTOR.fields}

    def stats(self) -> dict[str, dict[str, float]]:
        return {}

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "RemoteDrafter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, method: Any, message: Any) -> Any:
        return unary(method, message, "drafter", self.target, self.timeout_s)
