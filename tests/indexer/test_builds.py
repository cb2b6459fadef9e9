"""Builds of the live datastore against a real Redis server: conversations into shards once,
retention, and crash safety at every point of a build."""

import pytest
import redis

from sssd.common.conversations.publisher import ConversationPublisher
from sssd.datastore.build import read_documents
from sssd.datastore.manifest import read_manifest
from sssd.datastore.shard import read_meta
from sssd.indexer.builder import BUILD_POINTS
from sssd.indexer.indexer import Indexer

from support.indexing import (
    SimulatedCrash,
    add,
    conversations,
    crash_at,
    make_config,
    pending,
    poll_until,
    shard_sizes,
)


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
