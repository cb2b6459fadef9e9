"""The indexer: the conversation stream -> datastore shards, exactly once (DESIGN.md section 8).

It reads the stream through a consumer group and buffers valid conversations. When enough tokens
arrived (`build_tokens`) or the oldest buffered one has waited `build_interval_s`, it builds:

1. if the newest shard still has room (`shard_tokens`), a new shard holding its old documents
   plus the new ones replaces it; otherwise the new documents start new shards;
2. beyond `max_shards` the oldest shards leave the manifest;
3. the new manifest, naming the last stream entry it includes, replaces the old one atomically
   and durably (manifest.py);
4. only then are the entries acknowledged (XACK); shard directories no manifest names any more
   are deleted one build later (a drafter may still be switching away from them).

Crash safety. Shards are written under a temporary name and renamed, and the manifest is
replaced atomically, so after a crash at any point the directory holds the old manifest or the
new one. On start the indexer removes temporary and orphaned shard directories, then re-reads
the entries it was given but never acknowledged: those at or before the manifest's last entry
are already in the shards and are only acknowledged; the rest are indexed again. Nothing is lost
and nothing is indexed twice.

Entries that cannot be indexed (foreign tokenizer, ids outside the vocabulary, missing fields,
garbage) go to the dead-letter stream with the reason and the original fields, and are
acknowledged; they never stop the indexer.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sssd.common.flags import option
from sssd.common.ports import REDIS_PORT
from sssd.datastore.build import DEFAULT_SHARD_TOKENS, next_shard_index, shard_name
from sssd.datastore.manifest import EMPTY_MANIFEST, Manifest, read_manifest, write_manifest
from sssd.datastore.shard import SEPARATOR, make_stream, read_meta, write_shard
from sssd.indexer.conversations import (
    DEAD_LETTER_STREAM,
    STREAM,
    MalformedEntry,
    decode_entry,
    entry_key,
)

logger = logging.getLogger(__name__)

CRASH_POINTS = ("during_build", "after_build", "after_manifest")
LAG_COUNT_LIMIT = 100_000


class SimulatedCrash(RuntimeError):
    """Raised at a configured crash point (tests): the process 'dies' there."""


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
    shard_tokens: int = option(DEFAULT_SHARD_TOKENS, "tokens per shard (the paper's 512M)")
    max_shards: int = option(8, "active shards; beyond it the oldest leave the manifest")
    build_tokens: int = option(1_000_000, "build once this many new tokens are buffered ...")
    build_interval_s: float = option(60.0, "... or once the oldest buffered conversation is "
                                     "this old")
    read_count: int = 512  # entries per XREADGROUP
    block_ms: int = 1000

    def __post_init__(self) -> None:
        if self.shard_tokens < 2 or self.max_shards < 1 or self.build_tokens < 1:
            raise ValueError("need shard_tokens >= 2, max_shards >= 1 and build_tokens >= 1")
        if self.build_interval_s <= 0 or self.read_count < 1:
            raise ValueError("need build_interval_s > 0 and read_count >= 1")


@dataclass
class IndexerStats:
    entries_indexed: int = 0
    tokens_indexed: int = 0
    dead_lettered: int = 0
    builds: int = 0
    last_build_s: float = 0.0
    redis_errors: int = 0
    skipped_already_indexed: int = 0  # redelivered entries the manifest already holds


@dataclass
class _Buffer:
    ids: list[bytes] = field(default_factory=list)
    documents: list[list[int]] = field(default_factory=list)
    tokens: int = 0
    since: float | None = None  # monotonic time the oldest entry arrived

    def clear(self) -> None:
        self.ids, self.documents, self.tokens, self.since = [], [], 0, None


class Indexer:
    def __init__(self, config: IndexerConfig, crash_at: str | None = None) -> None:
        import redis

        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {CRASH_POINTS}")
        self.config = config
        self.crash_at = crash_at
        self.directory = Path(config.datastore_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.client = redis.Redis.from_url(config.redis_url, socket_timeout=5.0,
                                           socket_connect_timeout=2.0)
        self.stats = IndexerStats()
        self._buffer = _Buffer()
        self._retired: list[str] = []  # shards left out of the manifest, deleted next build
        self._recovered = False

    # --- start-up -------------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        return read_manifest(self.directory) or EMPTY_MANIFEST

    def recover(self) -> None:
        """Cleans up after a crash and takes back the entries never acknowledged."""
        import redis

        manifest = self.manifest
        for path in self.directory.glob(".shard-*.tmp"):  # a build cut short
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed an unfinished shard %s", path.name)
        for path in self.directory.glob("shard-*"):  # built, but its manifest never written
            if path.is_dir() and path.name not in manifest.shards:
                shutil.rmtree(path, ignore_errors=True)
                logger.info("removed shard %s, which no manifest names", path.name)
        try:
            self.client.xgroup_create(self.config.stream, self.config.group, id="0",
                                      mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        buffered = set(self._buffer.ids)  # after a reconnect some are already in the buffer
        start = "0"
        while True:  # our pending entries: delivered before, never acknowledged
            batch = self.client.xreadgroup(self.config.group, self.config.consumer,
                                           {self.config.stream: start},
                                           count=self.config.read_count)
            entries = batch[0][1] if batch else []
            if not entries:
                break
            self._take([(i, f) for i, f in entries if i not in buffered])
            start = entries[-1][0]
        self._recovered = True

    # --- the loop -----------------------------------------------------------------------------------

    def poll(self, block_ms: int | None = None) -> int:
        """Reads new entries (waiting up to block_ms), builds when due; returns entries read."""
        if not self._recovered:
            self.recover()
        batch = self.client.xreadgroup(
            self.config.group, self.config.consumer, {self.config.stream: ">"},
            count=self.config.read_count,
            block=self.config.block_ms if block_ms is None else block_ms)
        entries = batch[0][1] if batch else []
        self._take(entries)
        self.maybe_build()
        return len(entries)

    def run(self, stop: threading.Event) -> None:
        """Polls until `stop` is set; survives Redis outages (reconnects with backoff)."""
        import redis

        backoff = 0.1
        while not stop.is_set():
            try:
                self.poll()
                backoff = 0.1
            except redis.RedisError as exc:
                self.stats.redis_errors += 1
                logger.warning("Redis unavailable (%s); retrying in %.1f s", exc, backoff)
                self._recovered = False  # re-read our pending entries after reconnecting
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        # Entries still buffered stay pending in the group: the next start indexes them.

    @property
    def lag(self) -> int:
        """Stream entries not yet in the datastore: delivered but not acknowledged, plus not
        yet delivered (counted up to LAG_COUNT_LIMIT; Redis 6 has no XINFO lag field)."""
        for group in self.client.xinfo_groups(self.config.stream):
            name = group["name"]
            if (name.decode() if isinstance(name, bytes) else name) != self.config.group:
                continue
            last = group["last-delivered-id"]
            last = last.decode() if isinstance(last, bytes) else last
            undelivered = self.client.xrange(self.config.stream, min=f"({last}", max="+",
                                             count=LAG_COUNT_LIMIT)
            return int(group["pending"]) + len(undelivered)
        return -1

    # --- entries ----------------------------------------------------------------------------

    def _take(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        last = self.manifest.last_entry_id
        last_key = entry_key(last) if last else None
        for entry_id, fields in entries:
            if last_key is not None and entry_key(entry_id) <= last_key:
                # Indexed by a build whose acknowledgement never happened (crash): ack only.
                self.client.xack(self.config.stream, self.config.group, entry_id)
                self.stats.skipped_already_indexed += 1
                continue
            if not fields:  # pending, but trimmed out of the stream (MAXLEN) before indexing
                self._dead_letter(entry_id, {}, "entry trimmed from the stream before it was "
                                  "indexed")
                continue
            try:
                conversation = decode_entry(fields, self.config.vocab_size,
                                            self.config.tokenizer_fingerprint)
            except MalformedEntry as exc:
                self._dead_letter(entry_id, fields, str(exc))
                continue
            document = conversation.document
            if self._buffer.since is None:
                self._buffer.since = time.monotonic()
            self._buffer.ids.append(entry_id)
            self._buffer.documents.append(document)
            self._buffer.tokens += len(document) + 1

    def _dead_letter(self, entry_id: bytes, fields: dict[bytes, bytes], reason: str) -> None:
        letter = {b"reason": reason.encode(), b"entry_id": entry_id}
        letter.update({b"field:" + k: v for k, v in list(fields.items())[:32]})
        self.client.xadd(self.config.dead_letter_stream, letter, maxlen=100_000,
                         approximate=True)
        self.client.xack(self.config.stream, self.config.group, entry_id)
        self.stats.dead_lettered += 1
        logger.warning("dead-lettered stream entry %s: %s", entry_id.decode(), reason)

    # --- building -------------------------------------------------------------------------------

    def maybe_build(self, force: bool = False) -> Manifest | None:
        buffer = self._buffer
        if not buffer.ids:
            return None
        due = buffer.tokens >= self.config.build_tokens or \
            time.monotonic() - (buffer.since or 0) >= self.config.build_interval_s
        if not (force or due):
            return None
        return self.build()

    def build(self) -> Manifest:
        """Indexes the buffer into shards, publishes the manifest, then acknowledges."""
        start = time.perf_counter()
        config, buffer = self.config, self._buffer
        manifest = self.manifest
        names = list(manifest.shards)
        index = next_shard_index(manifest, self.directory)
        new_stream = make_stream(buffer.documents, config.vocab_size)
        retired: list[str] = []
        if names and read_meta(self.directory / names[-1]).num_tokens + new_stream.shape[0] \
                <= config.shard_tokens:
            newest = names.pop()  # rebuilt with its old content plus the new documents
            old = np.fromfile(self.directory / newest / "tokens.u32", dtype="<u4")
            streams = [np.concatenate([old, new_stream])]
            retired.append(newest)
        else:
            streams = list(_split(new_stream, config.shard_tokens))
        first, last = buffer.ids[0].decode(), buffer.ids[-1].decode()
        for stream in streams:
            name = shard_name(index)
            index += 1
            if self.crash_at == "during_build":
                partial = self.directory / f".{name}.crash.tmp"
                partial.mkdir()
                stream[: stream.shape[0] // 2].tofile(partial / "tokens.u32")
                raise SimulatedCrash("during_build")
            write_shard(self.directory / name, stream, config.vocab_size,
                        config.tokenizer_fingerprint, source_first=first, source_last=last)
            names.append(name)
        if self.crash_at == "after_build":
            raise SimulatedCrash("after_build")
        retired += names[: max(0, len(names) - config.max_shards)]
        names = names[-config.max_shards:]
        new_manifest = manifest.next(tuple(names), last)
        write_manifest(self.directory, new_manifest)
        if self.crash_at == "after_manifest":
            raise SimulatedCrash("after_manifest")
        self.client.xack(config.stream, config.group, *buffer.ids)
        for name in self._retired:  # retired one build ago: no drafter still switches to them
            shutil.rmtree(self.directory / name, ignore_errors=True)
        self._retired = retired
        self.stats.builds += 1
        self.stats.entries_indexed += len(buffer.ids)
        self.stats.tokens_indexed += buffer.tokens
        self.stats.last_build_s = time.perf_counter() - start
        logger.info("manifest v%d: %d shards, +%d entries (%d tokens) up to %s in %.2f s",
                    new_manifest.version, len(names), len(buffer.ids), buffer.tokens, last,
                    self.stats.last_build_s)
        buffer.clear()
        return new_manifest


def _split(stream: np.ndarray, shard_tokens: int):
    """Cuts a document stream into pieces of at most shard_tokens, at document boundaries."""
    ends = np.flatnonzero(stream == SEPARATOR) + 1
    start = 0
    while start < stream.shape[0]:
        limit = start + shard_tokens
        candidates = ends[(ends > start) & (ends <= limit)]
        if candidates.size:
            end = int(candidates[-1])
            yield stream[start:end]
        else:  # one document longer than a shard: cut, its tail starts the next shard
            end = limit - 1
            yield np.append(stream[start:end], SEPARATOR).astype(np.uint32)
        start = end
