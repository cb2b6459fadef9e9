"""The drafter over gRPC: same trees as in process, status codes, health, reflection, shutdown."""

from __future__ import annotations

import itertools
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from sssd import _core
from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import CapacityError, DraftRequest, SequenceNotFound
from sssd.common.rpc.status import parse_unknown_ids
from sssd.datastore.build import build_datastore
from sssd.drafter.client import RemoteDrafter
from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import LocalDrafter
from sssd.drafter.service import create_server
from sssd.v1 import drafter_pb2, drafter_pb2_grpc

VOCAB = 100
FINGERPRINT = "test-tokenizer"
MAX_BATCH = 4
MAX_BUDGET = 16
MAX_TOKENS = 64
TIMEOUT_S = 10.0
_ids = itertools.count()


def corpus(seed: int = 0, count: int = 60) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 30, size=rng.integers(10, 60)) for _ in range(count)]


def context(index: int, length: int = 20) -> list[int]:
    return corpus()[index][:length].tolist()


def new_id(name: str = "seq") -> str:
    return f"{name}-{next(_ids)}"


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> DrafterConfig:
    datastore_dir = tmp_path_factory.mktemp("datastore")
    build_datastore(datastore_dir, corpus(), VOCAB, FINGERPRINT, shard_tokens=800)
    return DrafterConfig(
        datastore_dir=str(datastore_dir), vocab_size=VOCAB, tokenizer_fingerprint=FINGERPRINT,
        num_threads=2, max_batch_size=MAX_BATCH, max_budget=MAX_BUDGET,
        max_tokens_per_sequence=MAX_TOKENS, port=0, max_workers=4, grace_s=1.0,
    )


@pytest.fixture(scope="module")
def server(config) -> Iterator[tuple[int, LocalDrafter]]:
    server, port, drafter = create_server(config)
    yield port, drafter
    server.stop(0).wait()
    drafter.close()


@pytest.fixture(scope="module")
def local(config) -> Iterator[LocalDrafter]:
    """An in-process drafter on the same datastore: what the service must reproduce."""
    drafter = LocalDrafter(config)
    drafter.start()
    yield drafter
    drafter.close()


@pytest.fixture(scope="module")
def channel(server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server[0]}") as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel) -> drafter_pb2_grpc.DrafterStub:
    return drafter_pb2_grpc.DrafterStub(channel)


@pytest.fixture(scope="module")
def remote(server) -> Iterator[RemoteDrafter]:
    with RemoteDrafter(f"127.0.0.1:{server[0]}", timeout_s=TIMEOUT_S) as remote:
        yield remote



def assert_valid(tree: DraftTree, budget: int, root: int) -> None:
    assert tree.token_ids.dtype == np.int32 and tree.parents.dtype == np.int32
    assert tree.probs is not None and tree.probs.dtype == np.float32
    assert 1 <= tree.num_nodes <= budget
    assert tree.root_token == root and tree.parents[0] == -1
    assert all(0 <= tree.parents[i] < i for i in range(1, tree.num_nodes))
    assert ((tree.token_ids >= 0) & (tree.token_ids < VOCAB)).all()
    assert _core.check_draft_tree(tree.token_ids, tree.parents, tree.probs, budget, root) == ""


def message(seq_id: str, token_ids: list[int], budget: int = 8, is_start: bool = False):
    return drafter_pb2.SequenceDraftRequest(
        seq_id=seq_id, new_token_ids=token_ids, budget=budget, is_start=is_start)


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_batched_propose_equals_in_process_drafter(remote, local):
    budgets = [1, 8, MAX_BUDGET]
    contexts = [context(i) for i in range(3)]
    ids = [new_id() for _ in budgets]
    start = [DraftRequest(s, c, b, is_start=True) for s, c, b in zip(ids, contexts, budgets)]
    trees = remote.propose(start)
    assert trees == local.propose(start)
    for tree, budget, ctx in zip(trees, budgets, contexts):
        assert_valid(tree, budget, ctx[-1])
    assert trees[2].num_nodes == MAX_BUDGET  # the contexts are in the datastore

    # Continuations send only the new tokens, possibly none, as numpy arrays or lists.
    step = [DraftRequest(ids[0], np.array([3, 4], dtype=np.int32), 8),
            DraftRequest(ids[1], [], 8), DraftRequest(ids[2], [5], MAX_BUDGET)]
    trees = remote.propose(step)
    assert trees == local.propose(step)
    for tree, budget, root in zip(trees, [8, 8, MAX_BUDGET], [4, contexts[1][-1], 5]):
        assert_valid(tree, budget, root)


def test_continuation_equals_a_restart_with_the_full_context(remote):
    ctx, seq_id = context(5, 30), new_id()
    remote.propose([DraftRequest(seq_id, ctx[:10], 8, is_start=True)])
    remote.propose([DraftRequest(seq_id, ctx[10:25], 8)])
    continued = remote.propose([DraftRequest(seq_id, ctx[25:], MAX_BUDGET)])
    restarted = remote.propose([DraftRequest(new_id(), ctx, MAX_BUDGET, is_start=True)])
    assert continued == restarted


def test_unknown_sequence_is_not_found_until_restarted(stub, remote):
    known, ghost = new_id(), new_id("ghost")
    stub.Propose(drafter_pb2.ProposeRequest(sequences=[message(known, context(1), is_start=True)]))
    batch = [message(known, [1]), message(ghost, [2])]
    err = rpc_error(lambda: stub.Propose(drafter_pb2.ProposeRequest(sequences=batch)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert ghost in err.details() and parse_unknown_ids(err.details()) == [ghost]

    with pytest.raises(SequenceNotFound) as caught:
        remote.propose([DraftRequest(known, [1], 8), DraftRequest(ghost, [2], 8)])
    assert caught.value.seq_ids == [ghost]

    trees = remote.propose([DraftRequest(known, [1], 8), DraftRequest(ghost, [2, 3], 8, True)])
    assert [t.root_token for t in trees] == [1, 3]


def test_end_sequences_frees_state(stub, remote):
    ids = [new_id(), new_id()]
    remote.propose([DraftRequest(s, context(2), 4, is_start=True) for s in ids])
    before = remote.info()["num_sequences"]
    response = stub.EndSequences(drafter_pb2.EndSequencesRequest(seq_ids=[*ids, new_id("never")]))
    assert response.num_ended == 2
    assert remote.info()["num_sequences"] == before - 2
    assert remote.end(ids) == 0  # ending is idempotent
    with pytest.raises(SequenceNotFound) as caught:
        remote.propose([DraftRequest(s, [1], 4) for s in ids])
    assert caught.value.seq_ids == ids


# case -> (the batch of a bad call, given S = a live sequence with 20 tokens that the call
# continues by [7, 8] and T = a new sequence that it starts; what the details must mention).
# The call must fail as a whole and change nothing.
BAD_BATCHES: dict[str, tuple[Callable[[str, str], list], str]] = {
    "token_id_at_vocab_size": (
        lambda s, t: [message(s, [7, 8]), message(t, [1, VOCAB], 4, True)], "vocabulary"),
    "negative_token_id": (
        lambda s, t: [message(s, [7, 8]), message(t, [1, -1], 4, True)], "vocabulary"),
    "empty_batch": (lambda s, t: [], "empty batch"),
    "batch_over_max_batch_size": (
        lambda s, t: [message(s, [7, 8]), message(t, [1], 4, True)]
        + [message(new_id(), [1], 4, True) for _ in range(MAX_BATCH - 1)], "max_batch_size"),
    "duplicate_seq_ids": (
        lambda s, t: [message(s, [7, 8]), message(t, [1], 4, True), message(t, [2], 4, True)],
        "twice"),
    "budget_zero": (lambda s, t: [message(s, [7, 8]), message(t, [1], 0, True)], "budget"),
    "budget_over_max_budget": (
        lambda s, t: [message(s, [7, 8]), message(t, [1], MAX_BUDGET + 1, True)], "budget"),
    "empty_seq_id": (
        lambda s, t: [message(s, [7, 8]), message(t, [1], 4, True), message("", [1], 4, True)],
        "seq_id"),
    "start_without_tokens": (
        lambda s, t: [message(s, [7, 8]), message(t, [], 4, True)], "no tokens"),
    "start_with_too_many_tokens": (
        lambda s, t: [message(s, [7, 8]), message(t, [1] * (MAX_TOKENS + 1), 4, True)],
        "max_tokens_per_sequence"),
    "continuation_past_max_tokens": (
        lambda s, t: [message(t, [1], 4, True), message(s, [7] * (MAX_TOKENS - 20 + 1))],
        "max_tokens_per_sequence"),
}


@pytest.mark.parametrize("case", BAD_BATCHES)
def test_bad_input_is_invalid_argument_and_changes_nothing(case, stub, remote, local):
    live, started, ctx = new_id(), new_id(), context(3)  # ctx: 20 tokens
    for drafter in (remote, local):
        drafter.propose([DraftRequest(live, ctx, 8, is_start=True)])
    num_sequences = remote.info()["num_sequences"]

    make_batch, what = BAD_BATCHES[case]
    bad = drafter_pb2.ProposeRequest(sequences=make_batch(live, started))
    err = rpc_error(lambda: stub.Propose(bad))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert what in err.details()

    assert remote.info()["num_sequences"] == num_sequences
    with pytest.raises(SequenceNotFound):
        remote.propose([DraftRequest(started, [1], 4)])
    step = [DraftRequest(live, [7, 8], MAX_BUDGET)]  # as if the bad call had never happened
    assert remote.propose(step) == local.propose(step)
    remote.end([live])
    local.end([live])


def test_client_raises_value_error_for_invalid_argument(remote):
    with pytest.raises(ValueError, match="budget"):
        remote.propose([DraftRequest(new_id(), [1], MAX_BUDGET + 1, is_start=True)])
    with pytest.raises(ValueError):  # refused by protobuf before sending: budget is uint32
        remote.propose([DraftRequest(new_id(), [1], -1, is_start=True)])


def test_full_sequence_table_is_resource_exhausted():
    config = DrafterConfig(vocab_size=VOCAB, max_sequences=2, num_threads=1, port=0)
    server, port, drafter = create_server(config)
    try:
        with RemoteDrafter(f"127.0.0.1:{port}", timeout_s=TIMEOUT_S) as remote:
            remote.propose([DraftRequest(s, [1, 2], 4, is_start=True) for s in ("a", "b")])
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = drafter_pb2_grpc.DrafterStub(channel)
                request = drafter_pb2.ProposeRequest(sequences=[message("c", [1], 4, True)])
                err = rpc_error(lambda: stub.Propose(request))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_sequences" in err.details()
            with pytest.raises(CapacityError):
                remote.propose([DraftRequest("c", [1], 4, is_start=True)])
            assert remote.end(["a"]) == 1
            assert remote.propose([DraftRequest("c", [1], 4, is_start=True)])[0].root_token == 1
    finally:
        server.stop(0).wait()
        drafter.close()


def test_get_info(stub, remote, local):
    info = stub.GetInfo(drafter_pb2.GetInfoRequest())
    assert info.vocab_size == VOCAB and info.tokenizer_fingerprint == FINGERPRINT
    assert info.max_batch_size == MAX_BATCH and info.max_budget == MAX_BUDGET
    assert info.manifest_version >= 1 and info.num_shards >= 2 and info.num_datastore_tokens > 0
    expected = {**local.info(), "num_sequences": info.num_sequences}
    assert remote.info() == expected


def test_health_reports_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("sssd.v1.Drafter", ""):
        response = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel):
    database = ProtoReflectionDescriptorDatabase(channel)
    services = database.get_services()
    assert "sssd.v1.Drafter" in services and "grpc.health.v1.Health" in services
    assert database.FindFileContainingSymbol("sssd.v1.Drafter").name == "sssd/v1/drafter.proto"


class GatedDrafter:
    """A stand-in drafter whose propose waits for `release`, or fails like a bug for "boom"."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        if requests[0].seq_id == "boom":
            raise KeyError("boom")  # not SequenceNotFound: an internal error
        self.entered.set()
        self.release.wait(TIMEOUT_S)
        return [DraftTree.root_only(int(np.asarray(r.token_ids)[-1])) for r in requests]


def test_unexpected_errors_are_internal():
    server, port, _ = create_server(DrafterConfig(vocab_size=VOCAB, port=0), GatedDrafter())
    try:
        with RemoteDrafter(f"127.0.0.1:{port}", timeout_s=TIMEOUT_S) as remote:
            with pytest.raises(RuntimeError, match="INTERNAL"):
                remote.propose([DraftRequest("boom", [1], 4, is_start=True)])
    finally:
        server.stop(0).wait()


def test_stop_drains_calls_in_flight_and_refuses_new_ones():
    drafter = GatedDrafter()
    server, port, _ = create_server(DrafterConfig(vocab_size=VOCAB, port=0), drafter)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        request = drafter_pb2.ProposeRequest(sequences=[message("a", [1, 2], 4, True)])
        in_flight = stub.Propose.future(request, timeout=TIMEOUT_S)
        assert drafter.entered.wait(TIMEOUT_S)
        stopped = server.stop(grace=TIMEOUT_S)
        with RemoteDrafter(f"127.0.0.1:{port}", timeout_s=TIMEOUT_S) as remote:
            with pytest.raises(ConnectionError):
                remote.propose([DraftRequest("b", [3], 4, is_start=True)])
        drafter.release.set()
        assert list(in_flight.result().drafts[0].token_ids) == [2]
        assert stopped.wait(TIMEOUT_S)


def test_sigterm_reports_not_serving_and_exits_cleanly(config, spawn_service):
    process, port = spawn_service([
        sys.executable, "-m", "sssd.drafter.service", "--port", "0", "--vocab-size", str(VOCAB),
        "--datastore-dir", config.datastore_dir, "--num-threads", "1", "--grace-s", "5"])
    # The grace period outlasts a slow reader of the NOT_SERVING update on a busy machine; the
    # process still exits at once when this client closes its Watch stream.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="sssd.v1.Drafter"), timeout=TIMEOUT_S)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert process.wait(timeout=TIMEOUT_S) == 0, process.stderr.read()[-4000:]  # an abort says why
    assert "drafter stopped" in process.stderr.read()
