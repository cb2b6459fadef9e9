"""The drafter's gRPC service (proto/sssd/v1/drafter.proto): a thin shell around `LocalDrafter`.

The servicer only translates between protobuf messages and the Python drafter API, and Python
exceptions into gRPC status codes; all validation and all state live in `LocalDrafter`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sssd.common.config.logs import configure_logging
from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import DraftRequest
from sssd.common.rpc import tls
from sssd.common.rpc.server import serve_until_signal
from sssd.common.rpc.status import call_or_abort
from sssd.common.rpc.targets import address
from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import LocalDrafter
from sssd.v1 import drafter_pb2, drafter_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name  # "sssd.v1.Drafter"
_MAX_MESSAGE_BYTES = 2**31 - 1

T = TypeVar("T")


def _int32_array(values: Sequence[int]) -> np.ndarray:
    # upb's repeated fields convert in bulk here: ~100x faster than np.fromiter or a list.
    return np.asarray(values, dtype=np.int32)  # [num_tokens]


def _tree_to_proto(tree: DraftTree) -> drafter_pb2.DraftTree:
    return drafter_pb2.DraftTree(
        token_ids=tree.token_ids.tolist(),
        parents=tree.parents.tolist(),
        probs=tree.probs.tolist() if tree.probs is not None else (),
    )


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Wire <-> `LocalDrafter`. Every failure leaves the drafter's state unchanged (its
    contract)."""

    def __init__(self, drafter: LocalDrafter) -> None:
        self._drafter = drafter

    def Propose(
        self, request: drafter_pb2.ProposeRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.ProposeResponse:
        def propose() -> list[DraftTree]:
            return self._drafter.propose([
                DraftRequest(
                    seq_id=seq.seq_id,
                    token_ids=_int32_array(seq.new_token_ids),
                    budget=seq.budget,
                    is_start=seq.is_start,
                )
                for seq in request.sequences
            ])

        trees = _call(context, "Propose", propose)
        return drafter_pb2.ProposeResponse(drafts=[_tree_to_proto(tree) for tree in trees])

    def EndSequences(
        self, request: drafter_pb2.EndSequencesRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.EndSequencesResponse:
        num_ended = _call(context, "EndSequences", lambda: self._drafter.end(list(request.seq_ids)))
        return drafter_pb2.EndSequencesResponse(num_ended=num_ended)

    def GetInfo(
        self, request: drafter_pb2.GetInfoRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.DrafterInfo:
        info = _call(context, "GetInfo", self._drafter.info)
        fields = drafter_pb2.DrafterInfo.DESCRIPTOR.fields_by_name
        # None (no datastore, no fingerprint) is the proto default: 0 or "".
        return drafter_pb2.DrafterInfo(
            **{name: value for name, value in info.items() if name in fields and value is not None}
        )


def _call(context: grpc.ServicerContext, rpc: str, fn: Callable[[], T]) -> T:
    """Runs fn, turning the drafter's exceptions into the status codes of drafter.proto."""
    return call_or_abort(context, rpc, fn, "drafter")


def _max_request_bytes(config: DrafterConfig) -> int:
    """A bound on a legal ProposeRequest: full contexts for a whole batch (<= 5 bytes a token)."""
    per_sequence = 5 * config.max_tokens_per_sequence + 1024
    return min(_MAX_MESSAGE_BYTES, config.max_batch_size * per_sequence + 1024)


def _start(
    config: DrafterConfig, drafter: LocalDrafter | None
) -> tuple[grpc.Server, int, LocalDrafter, health.HealthServicer]:
    owns_drafter = drafter is None
    if drafter is None:
        drafter = LocalDrafter(config)
        drafter.start()
    try:
        server = grpc.server(
            futures.ThreadPoolExecutor(config.max_workers, thread_name_prefix="drafter-rpc"),
            options=[("grpc.max_receive_message_length", _max_request_bytes(config))],
        )
        drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(drafter), server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        port = tls.bind(server, address(config.host, config.port))
        server.start()
    except BaseException:
        if owns_drafter:
            drafter.close()
        raise
    for service in (SERVICE_NAME, ""):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, port, drafter, health_servicer


def create_server(
    config: DrafterConfig, drafter: LocalDrafter | None = None
) -> tuple[grpc.Server, int, LocalDrafter]:
    """Starts a drafter server on config.host:config.port; returns it, its port and its drafter.

    With port 0 the OS picks a free port (tests). Health checking ("sssd.v1.Drafter" and "")
    reports SERVING once this returns. Without `drafter`, one is built from `config` and started
    here; either way the caller closes the drafter after `server.stop(grace).wait()`.
    """
    server, port, drafter, _ = _start(config, drafter)
    return server, port, drafter


def serve(config: DrafterConfig) -> None:
    """Serves until SIGTERM or SIGINT, then drains in-flight calls for config.grace_s seconds."""
    server, port, drafter, health_servicer = _start(config, None)
    logger.info("drafter listening on %s", address(config.host, port))
    try:
        serve_until_signal(server, health_servicer, config.grace_s)
    finally:
        drafter.close()
    logger.info("drafter stopped")


def main(argv: list[str] | None = None) -> None:
    """Console script `sssd-drafter`. Log level: SSSD_LOG_LEVEL (default INFO)."""
    configure_logging("INFO")
    config = DrafterConfig.from_args(argv)
    logger.debug("config: %s", config)
    serve(config)


if __name__ == "__main__":
    main()
