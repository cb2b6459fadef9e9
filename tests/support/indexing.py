"""Helpers of the live-datastore tests: a tiny vocabulary, random conversations, the indexer's
configuration against the test's Redis and stream names, and a fault hook that crashes."""

import time

import numpy as np
import pytest

from sssd.common.conversations.record import Conversation
from sssd.datastore.manifest import read_manifest
from sssd.datastore.shard import read_meta
from sssd.indexer.indexer import IndexerConfig

VOCAB = 500
FINGERPRINT = "f" * 64


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


def shard_sizes(config):
    manifest = read_manifest(config.datastore_dir)
    return [read_meta(f"{config.datastore_dir}/{name}").num_tokens for name in manifest.shards]


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
