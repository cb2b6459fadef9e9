"""Size-tiered compaction of the live datastore: the merge plan, merges beside builds, and crash
safety at every point of a merge."""

import threading
import time

import pytest
import redis

from sssd.datastore.build import read_documents
from sssd.datastore.manifest import read_manifest
from sssd.datastore.shard import read_meta
from sssd.indexer.builder import keep_newest
from sssd.indexer.compaction import MERGE_POINTS, plan_merge, tier
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
