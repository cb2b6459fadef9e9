"""Sticky routing across drafter replicas: rendezvous hashing, target parsing, the move of a
lost replica's sequences, and three real drafter processes with one killed under load."""

from __future__ import annotations

import signal
import sys

import pytest

from sssd.common.drafting.proposer import DraftRequest, SequenceNotFound
from sssd.common.rpc.targets import DnsResolver, StaticResolver, parse_targets, rendezvous_owner
from sssd.drafter.client import RemoteDrafter
from sssd.drafter.replicas import ReplicatedDrafter, connect
from sssd.verifier.engine import GenerateRequest
from sssd.verifier.engine.config import EngineConfig

REPLICAS = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


def test_rendezvous_is_deterministic_balanced_and_moves_only_the_lost_replicas_sequences():
    ids = [f"seq-{i}" for i in range(3000)]
    owners = {seq_id: rendezvous_owner(seq_id, REPLICAS) for seq_id in ids}
    assert owners == {seq_id: rendezvous_owner(seq_id, list(reversed(REPLICAS)))
                      for seq_id in ids}  # the order of the list does not matter
    for replica in REPLICAS:
        assert 800 < sum(owner == replica for owner in owners.values()) < 1200
    survivors = REPLICAS[:1] + REPLICAS[2:]
    for seq_id, owner in owners.items():
        new = rendezvous_owner(seq_id, survivors)
        assert new == owner if owner != REPLICAS[1] else new in survivors


def test_targets_are_parsed_and_malformed_ones_refused():
    assert parse_targets("127.0.0.1:1") == StaticResolver(("127.0.0.1:1",))
    assert parse_targets("a:1, b:2") == StaticResolver(("a:1", "b:2"))
    assert parse_targets("dns:///drafter.ns.svc:50051") == DnsResolver("drafter.ns.svc", 50051)
    assert DnsResolver("127.0.0.1", 7).resolve() == ["127.0.0.1:7"]
    for bad in ("nohost", "a:1,a:1", "a:x", "dns:///name", "a:1,"):
        with pytest.raises(ValueError):
            parse_targets(bad)
    with pytest.raises(ValueError, match="HOST:PORT"):
        EngineConfig(drafter_target="a:1,b")
    single = connect("127.0.0.1:1")
    several = connect("127.0.0.1:1,127.0.0.1:2")
    assert isinstance(single, RemoteDrafter) and isinstance(several, ReplicatedDrafter)
    single.close()
    several.close()


def fake_cluster(fake_proposer):
    replicas = {}

    def client(target, timeout_s):
        replicas[target] = fake_proposer()
        return replicas[target]

    drafter = ReplicatedDrafter(StaticResolver(tuple(REPLICAS)), client=client, down_s=60)
    return drafter, replicas


def test_sequences_stick_to_their_owner_and_move_when_it_is_lost(fake_proposer):
    drafter, replicas = fake_cluster(fake_proposer)
    ids = [f"s{i}" for i in range(12)]
    drafter.propose([DraftRequest(s, [1, 2], 4, is_start=True) for s in ids])
    owners = {s: drafter.owner_of(s) for s in ids}
    assert owners == {s: rendezvous_owner(s, REPLICAS) for s in ids}
    assert len(set(owners.values())) == 3  # all three replicas hold some
    drafter.propose([DraftRequest(s, [3], 4) for s in ids])
    for s in ids:
        assert replicas[owners[s]].contexts[s] == [1, 2, 3]  # one replica holds it all
    lost = REPLICAS[1]
    replicas[lost].failure = ConnectionError(f"drafter at {lost} is unreachable")
    with pytest.raises(SequenceNotFound) as missing:
        drafter.propose([DraftRequest(s, [4], 4) for s in ids])
    # Every sequence of the call must re-send: the lost replica's moved, the others' were
    # ended where they had already taken the tokens (so the re-send is exact).
    assert sorted(missing.value.seq_ids) == sorted(ids)
    assert drafter.info()["down"] == [lost]
    assert all(not r.contexts for t, r in replicas.items() if t != lost)
    drafter.propose([DraftRequest(s, [1, 2, 3, 4], 4, is_start=True) for s in ids])
    for s in ids:
        owner = drafter.owner_of(s)
        assert owner != lost and replicas[owner].contexts[s] == [1, 2, 3, 4]
        if owners[s] != lost:
            assert owner == owners[s]  # only the lost replica's sequences moved
    assert drafter.num_moved == sum(o == lost for o in owners.values())
    assert drafter.end(ids + ["unknown"]) == len(ids)


def test_a_sequence_of_a_replica_lost_between_calls_is_not_found(fake_proposer):
    drafter, replicas = fake_cluster(fake_proposer)
    drafter.propose([DraftRequest("a", [1], 4, is_start=True)])
    owner = drafter.owner_of("a")
    drafter._down[owner] = float("inf")  # it failed for another sequence's call
    with pytest.raises(SequenceNotFound) as missing:
        drafter.propose([DraftRequest("a", [2], 4)])
    assert missing.value.seq_ids == ["a"]
    drafter.propose([DraftRequest("a", [1, 2], 4, is_start=True)])
    assert drafter.owner_of("a") != owner


def test_no_reachable_replica_is_a_connection_error():
    drafter = ReplicatedDrafter(StaticResolver(("127.0.0.1:1", "127.0.0.1:2")), timeout_s=0.2,
                                down_s=60)
    with pytest.raises(SequenceNotFound):  # both unreachable: marked down, sequences re-sent
        drafter.propose([DraftRequest("a", [1], 4, is_start=True),
                         DraftRequest("b", [1], 4, is_start=True)])
    with pytest.raises(ConnectionError, match="no drafter replica is reachable"):
        drafter.propose([DraftRequest("a", [1], 4, is_start=True)])
    drafter.close()


def test_a_lost_replica_comes_back_once_its_health_check_serves(free_port, wait_until):
    """Real gRPC, in process: a replica that stops is marked down and its sequences move; once
    it serves again on its address the background health check takes it back."""
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.service import create_server

    port = free_port()
    config = DrafterConfig(vocab_size=100, port=port, num_threads=1)
    server, _, _ = create_server(config)
    other, other_port, _ = create_server(DrafterConfig(vocab_size=100, port=0, num_threads=1))
    targets = (f"127.0.0.1:{port}", f"127.0.0.1:{other_port}")
    drafter = ReplicatedDrafter(StaticResolver(targets), timeout_s=2.0, down_s=0.2)
    try:
        # Rendezvous hashing over two replicas: 8 sequences all went to one of them in one run
        # of 128 (the ports change from run to run), 64 do in one of 2^63.
        ids = [f"s{i}" for i in range(64)]
        drafter.propose([DraftRequest(s, [1, 2], 4, is_start=True) for s in ids])
        on_first = [s for s in ids if drafter.owner_of(s) == targets[0]]
        assert on_first
        server.stop(0).wait()
        with pytest.raises(SequenceNotFound) as missing:
            drafter.propose([DraftRequest(s, [3], 4) for s in ids])
        assert set(on_first) <= set(missing.value.seq_ids)
        assert drafter.info()["down"] == [targets[0]]
        drafter.propose([DraftRequest(s, [1, 2, 3], 4, is_start=True) for s in ids])
        assert all(drafter.owner_of(s) == targets[1] for s in ids)  # all on the survivor
        server, _, _ = create_server(config)  # back on the same address
        assert wait_until(lambda: targets[0] in drafter.live_replicas(), timeout=10)
        drafter.propose([DraftRequest("new", [5], 4, is_start=True)])
        assert drafter.info()["down"] == []
    finally:
        drafter.close()
        server.stop(0).wait()
        other.stop(0).wait()


def test_three_replicas_one_killed_under_load(warm_datastore, target_model_fp32, engine_factory,
                                              mt_bench_prompts, greedy_references,
                                              spawn_service):
    args = [sys.executable, "-m", "sssd.drafter.service", "--port", "0", "--vocab-size",
            str(target_model_fp32.vocab_size), "--datastore-dir", warm_datastore,
            "--num-threads", "1"]
    processes, targets = [], []
    for _ in range(3):
        process, port = spawn_service(args)
        processes.append(process)
        targets.append(f"127.0.0.1:{port}")
    drafter = ReplicatedDrafter(StaticResolver(tuple(targets)), timeout_s=5.0, down_s=60)
    engine, _ = engine_factory(4, proposer=drafter, max_budget=8)
    prompts = [0, 2, 4, 6]  # their answers are in the datastore: drafts get accepted
    sequences = [engine.add_request(GenerateRequest(tuple(mt_bench_prompts[i]), 40))
                 for i in prompts]
    killed, accepted_after = None, 0
    while engine.has_work():
        step = engine.step()
        if killed is None and engine.stats.num_steps >= 4:
            owners = {drafter.owner_of(s.request_id) for s in sequences if not s.is_finished}
            killed = sorted(owners - {None})[0]
            processes[targets.index(killed)].send_signal(signal.SIGKILL)
            processes[targets.index(killed)].wait(10)
            moved = [s.request_id for s in sequences
                     if drafter.owner_of(s.request_id) == killed]
        elif killed is not None:
            accepted_after += sum(row.num_accepted for row in step.rows)
    for index, seq in zip(prompts, sequences):
        assert seq.output_ids == greedy_references[index][:40]  # no request failed or changed
    assert moved and drafter.num_moved == len(moved)
    assert drafter.info()["down"] == [killed]
    assert accepted_after > 0  # drafting went on, on the surviving replicas
    engine.close()
