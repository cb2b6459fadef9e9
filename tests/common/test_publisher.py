"""The conversation publisher (sssd.common.conversations.publisher): its disk spool while Redis
is away, once per request, and a full spool."""

import time

import numpy as np
import redis

from sssd.common.conversations.publisher import ConversationPublisher
from sssd.common.conversations.record import Conversation
from sssd.common.conversations.redis_server import RedisServer
from sssd.datastore.build import read_documents
from sssd.indexer.indexer import Indexer

from support.indexing import FINGERPRINT, conversations, make_config, poll_until


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
