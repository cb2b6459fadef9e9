"""The indexer service and the drafters that read what it builds: new manifests picked up,
health and metrics."""

import time

import redis

from sssd.common.conversations.record import Conversation
from sssd.common.drafting.proposer import DraftRequest
from sssd.datastore.build import read_documents
from sssd.datastore.manifest import read_manifest
from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import LocalDrafter
from sssd.indexer.indexer import Indexer

from support.indexing import (
    FINGERPRINT,
    VOCAB,
    add,
    conversations,
    make_config,
    poll_until,
    shard_sizes,
)


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
