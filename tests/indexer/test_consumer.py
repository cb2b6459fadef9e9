"""The indexer's side of the stream: trimming only what is indexed, dead letters, and a Redis
restart ridden out."""

import threading
import time

import redis

from sssd.common.conversations.publisher import ConversationPublisher
from sssd.common.conversations.record import Conversation
from sssd.common.conversations.redis_server import RedisServer
from sssd.datastore.build import read_documents
from sssd.indexer.indexer import Indexer

from support.indexing import (
    FINGERPRINT,
    VOCAB,
    add,
    conversations,
    make_config,
    pending,
)


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
