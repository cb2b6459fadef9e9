"""The indexer: the conversation stream -> datastore shards, exactly once.

It reads the stream through a consumer group (consumer.py) and buffers valid conversations.
When enough tokens arrived (`build_tokens`) or the oldest buffered one has waited
`build_interval_s`, it builds (builder.py):

1. the buffered documents become new small shards: a build costs what its own tokens cost,
   whatever the size of the datastore;
2. beyond `max_shards` x `shard_tokens` tokens the oldest shards leave the manifest;
3. the new manifest, naming the last stream entry it includes, replaces the old one atomically
   and durably;
4. only then are the entries acknowledged, and the stream is trimmed up to the oldest entry not
   yet indexed.

In the background, small shards are merged in size tiers (compaction.py), published through the
same atomic manifest.

Crash safety: after a crash at any point of a build or a merge the directory holds the old
manifest or the new one. On start the indexer removes temporary and orphaned shard
directories, then re-reads the entries it was given but never acknowledged: those at or before
the manifest's last entry are already in the shards and are only acknowledged; the rest are
indexed again. Nothing is lost and nothing is indexed twice.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import redis

from sssd.common.config.flags import option
from sssd.common.conversations.record import DEAD_LETTER_STREAM, STREAM
from sssd.common.conversations.redis_server import connect
from sssd.common.rpc.ports import REDIS_PORT
from sssd.datastore.build import DEFAULT_SHARD_TOKENS
from sssd.datastore.manifest import Manifest
from sssd.indexer.builder import FaultHook, ShardStore, no_fault
from sssd.indexer.compaction import Compactor
from sssd.indexer.consumer import Document, Entry, StreamConsumer

logger = logging.getLogger(__name__)

BACKLOG_CHECK_S = 10.0  # how often the stream's unindexed backlog is compared with the alert


@dataclass(frozen=True)
class IndexerConfig:
    datastore_dir: str  # the live datastore: manifest.json and the shard directories
    vocab_size: int  # token ids must be below it
    tokenizer_fingerprint: str  # entries from another tokenizer are dead-lettered
    redis_url: str = option(f"redis://127.0.0.1:{REDIS_PORT}/0",
                            "the Redis of the conversation stream")
    stream: str = option(STREAM, "the conversation stream")
    dead_letter_stream: str = DEAD_LETTER_STREAM
    group: str = "sssd-indexer"
    consumer: str = "indexer-0"
    shard_tokens: int = option(DEFAULT_SHARD_TOKENS, "largest shard, in tokens (the paper's 512M)")
    max_shards: int = option(8, "the datastore keeps at most max_shards x shard_tokens tokens; "
                             "beyond, the oldest shards leave the manifest")
    # Small, frequent builds: a build costs what its own tokens cost (merges keep the shard
    # count down), so served conversations reach the drafters within seconds.
    build_tokens: int = option(20_000, "build once this many new tokens are buffered ...")
    build_interval_s: float = option(30.0, "... or once the oldest buffered conversation is "
                                     "this old")
    merge_fanout: int = option(4, "shards of one size tier merged into one (LSM compaction)")
    merge_base_tokens: int = option(4_096, "shards below base x fanout tokens are tier 0")
    retire_grace_s: float = option(30.0, "seconds a shard left out of the manifest stays on disk")
    backlog_alert_entries: int = option(1_000_000, "unindexed stream entries beyond which the "
                                        "indexer alerts (the stream is never trimmed past them)")
    read_count: int = 512  # entries per XREADGROUP
    block_ms: int = 1000

    def __post_init__(self) -> None:
        if self.shard_tokens < 2 or self.max_shards < 1 or self.build_tokens < 1:
            raise ValueError("need shard_tokens >= 2, max_shards >= 1 and build_tokens >= 1")
        if self.build_interval_s <= 0 or self.read_count < 1:
            raise ValueError("need build_interval_s > 0 and read_count >= 1")
        if self.merge_fanout < 2 or self.merge_base_tokens < 1:
            raise ValueError("need merge_fanout >= 2 and merge_base_tokens >= 1")
        if self.retire_grace_s < 0 or self.backlog_alert_entries < 1:
            raise ValueError("need retire_grace_s >= 0 and backlog_alert_entries >= 1")


@dataclass
class IndexerStats:
    """A snapshot of what the indexer did, for its metrics."""

    entries_indexed: int = 0
    tokens_indexed: int = 0
    dead_lettered: int = 0
    builds: int = 0
    last_build_s: float = 0.0
    merges: int = 0
    tokens_merged: int = 0  # tokens re-indexed by merges (the compaction's write amplification)
    last_merge_s: float = 0.0
    trimmed: int = 0  # stream entries deleted after they were indexed
    backlog_alerts: int = 0
    redis_errors: int = 0
    skipped_already_indexed: int = 0  # redelivered entries the manifest already holds


@dataclass
class _Buffer:
    documents: list[Document] = field(default_factory=list)
    tokens: int = 0
    since: float | None = None  # monotonic time the oldest entry arrived

    def add(self, document: Document) -> None:
        if self.since is None:
            self.since = time.monotonic()
        self.documents.append(document)
        self.tokens += len(document.token_ids) + 1

    def clear(self) -> None:
        self.documents, self.tokens, self.since = [], 0, None


class Indexer:
    def __init__(self, config: IndexerConfig, fault: FaultHook = no_fault) -> None:
        """`fault`: called at every point of a build or a merge where a crash must lose nothing
        (builder.BUILD_POINTS, compaction.MERGE_POINTS); tests raise there."""
        self.config = config
        self.client = connect(config.redis_url, socket_timeout=5.0, socket_connect_timeout=2.0)
        self.store = ShardStore(config.datastore_dir, config.vocab_size,
                                config.tokenizer_fingerprint, config.shard_tokens,
                                config.retire_grace_s, fault)
        self.compactor = Compactor(self.store, config.merge_base_tokens, config.merge_fanout)
        self.consumer = StreamConsumer(self.client, config.stream, config.group,
                                       config.consumer, config.dead_letter_stream,
                                       config.vocab_size, config.tokenizer_fingerprint,
                                       config.read_count, config.backlog_alert_entries)
        self._buffer = _Buffer()
        self._builds = 0
        self._entries_indexed = 0
        self._tokens_indexed = 0
        self._last_build_s = 0.0
        self._redis_errors = 0
        self._cleaned = False
        self._recovered = False
        self._merge_due = threading.Event()

    @property
    def directory(self):
        return self.store.directory

    @property
    def manifest(self) -> Manifest:
        return self.store.manifest

    @property
    def stats(self) -> IndexerStats:
        consumed, merged = self.consumer.stats, self.compactor.stats
        return IndexerStats(
            entries_indexed=self._entries_indexed, tokens_indexed=self._tokens_indexed,
            dead_lettered=consumed.dead_lettered, builds=self._builds,
            last_build_s=self._last_build_s, merges=merged.merges,
            tokens_merged=merged.tokens_merged, last_merge_s=merged.last_merge_s,
            trimmed=consumed.trimmed, backlog_alerts=consumed.backlog_alerts,
            redis_errors=self._redis_errors,
            skipped_already_indexed=consumed.skipped_already_indexed)

    # --- start-up -------------------------------------------------------------------------------

    def clean(self) -> None:
        """Removes what a crash left (builder.ShardStore.clean); once, at start."""
        if self._cleaned:
            return
        self.store.clean()
        self._cleaned = True
        self._merge_due.set()  # shards left by a previous run may be due for a merge

    def recover(self) -> None:
        """Cleans up after a crash and takes back the entries never acknowledged."""
        self.clean()
        # After a reconnect some are already in the buffer.
        buffered = {document.entry_id for document in self._buffer.documents}
        self._take([(i, f) for i, f in self.consumer.pending() if i not in buffered])
        self._recovered = True

    # --- the loop ------------------------------------------------------------------------------

    def poll(self, block_ms: int | None = None) -> int:
        """Reads new entries (waiting up to block_ms), builds when due; returns entries read."""
        if not self._recovered:
            self.recover()
        entries = self.consumer.read(self.config.block_ms if block_ms is None else block_ms)
        dead = self.consumer.stats.dead_lettered
        self._take(entries)
        if self.maybe_build() is None and self.consumer.stats.dead_lettered != dead:
            self.trim()  # dead letters are acknowledged at once: trim them too
        if time.monotonic() - self.consumer.backlog_checked >= BACKLOG_CHECK_S:
            self.check_backlog()
        return len(entries)

    def run(self, stop: threading.Event) -> None:
        """Polls until `stop` is set; survives Redis outages (reconnects with backoff). Merges
        run in a background thread meanwhile."""
        self.clean()
        merger = threading.Thread(target=self._merge_loop, args=(stop,), name="shard-merger",
                                  daemon=True)
        merger.start()
        backoff = 0.1
        while not stop.is_set():
            try:
                self.poll()
                backoff = 0.1
            except redis.RedisError as exc:
                self._redis_errors += 1
                logger.warning("Redis unavailable (%s); retrying in %.1f s", exc, backoff)
                self._recovered = False  # re-read our pending entries after reconnecting
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        self._merge_due.set()
        merger.join()
        # Entries still buffered stay pending in the group: the next start indexes them.

    def _merge_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._merge_due.wait(5.0)
            self._merge_due.clear()
            try:
                while not stop.is_set() and self.merge_once() is not None:
                    pass
            except Exception:  # noqa: BLE001 - a failed merge leaves the manifest as it was
                logger.exception("shard merge failed; the datastore is unchanged, retrying later")
                stop.wait(5.0)

    def _take(self, entries: list[Entry]) -> None:
        for document in self.consumer.documents(entries, self.manifest.last_entry_id):
            self._buffer.add(document)

    # --- the stream's length ----------------------------------------------------------------------

    @property
    def lag(self) -> int:
        return self.consumer.lag

    def trim(self) -> int:
        return self.consumer.trim()

    def check_backlog(self) -> int:
        return self.consumer.check_backlog()

    # --- building and merging --------------------------------------------------------------------

    def maybe_build(self, force: bool = False) -> Manifest | None:
        buffer = self._buffer
        if not buffer.documents:
            return None
        due = buffer.tokens >= self.config.build_tokens or \
            time.monotonic() - (buffer.since or 0) >= self.config.build_interval_s
        if not (force or due):
            return None
        return self.build()

    def build(self) -> Manifest:
        """Indexes the buffer into new shards, publishes the manifest, then acknowledges."""
        start = time.perf_counter()
        config, buffer = self.config, self._buffer
        ids = [document.entry_id for document in buffer.documents]
        manifest, num_shards = self.store.build(
            [document.token_ids for document in buffer.documents], ids[0].decode(),
            ids[-1].decode(), config.max_shards * config.shard_tokens)
        # The entries are in the datastore from here on: out of the buffer before anything
        # else can fail, so a Redis error below never gets them indexed twice (the ones left
        # unacknowledged come back on reconnect and are only acknowledged).
        tokens = buffer.tokens
        buffer.clear()
        self._merge_due.set()
        self._builds += 1
        self._entries_indexed += len(ids)
        self._tokens_indexed += tokens
        self._last_build_s = time.perf_counter() - start
        logger.info("manifest v%d: %d shards, +%d entries (%d tokens) up to %s in %.2f s",
                    manifest.version, num_shards, len(ids), tokens, ids[-1].decode(),
                    self._last_build_s)
        self.consumer.acknowledge(ids)
        self.trim()
        return manifest

    def merge_once(self) -> Manifest | None:
        return self.compactor.merge_once()

    def merge_all(self) -> int:
        return self.compactor.merge_all()
