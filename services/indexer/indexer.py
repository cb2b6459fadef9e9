"""The indexer: the conversation stream -> datastore shards, exactly once (DESIGN.md section 8).

It reads the stream through a consumer group and buffers valid conversations. When enough tokens
arrived (`build_tokens`) or the oldest buffered one has waited `build_interval_s`, it builds:

1. the buffered documents become a new small shard (several when they exceed `shard_tokens`):
   a build costs what its own tokens cost, whatever the size of the datastore;
2. beyond `max_shards` x `shard_tokens` tokens the oldest shards leave the manifest;
3. the new manifest, naming the last stream entry it includes, replaces the old one atomically
   and durably (manifest.py);
4. only then are the entries acknowledged (XACK), and the stream is trimmed up to the oldest
   entry not yet indexed (XTRIM MINID): nothing unindexed is ever trimmed. Producers do not trim;
   a stream that grows past its alert length because the indexer lags is reported (log, metric),
   never cut.

In the background, small shards are merged in size tiers (compaction.py): `merge_fanout`
neighbouring shards of one tier become one shard of the next tier. A merge changes which shards
hold the documents, never which documents are held nor their order, and publishes its result
through the same atomic manifest. Shard directories no manifest names any more are deleted
`retire_grace_s` later (a drafter may still be switching away from them).

Crash safety. Shards are written under a temporary name and renamed, and the manifest is
replaced atomically, so after a crash at any point (of a build or of a merge) the directory holds
the old manifest or the new one. On start the indexer removes temporary and orphaned shard
directories, then re-reads the entries it was given but never acknowledged: those at or before
the manifest's last entry are already in the shards and are only acknowledged; the rest are
indexed again. Nothing is lost and nothing is indexed twice.

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

from sssd.common.config.flags import option
from sssd.common.rpc.ports import REDIS_PORT
from sssd.datastore.build import DEFAULT_SHARD_TOKENS, next_shard_index, shard_name
from sssd.datastore.manifest import EMPTY_MANIFEST, Manifest, read_manifest, write_manifest
from sssd.datastore.shard import SEPARATOR, make_stream, read_meta, write_shard
from sssd.indexer.compaction import keep_newest, plan_merge
from sssd.common.conversations.redis_server import connect
from sssd.common.conversations.record import (
    DEAD_LETTER_STREAM,
    STREAM,
    MalformedEntry,
    decode_entry,
    entry_key,
)

logger = logging.getLogger(__name__)

CRASH_POINTS = ("during_build", "after_build", "after_manifest",
                "during_merge", "after_merge_build", "after_merge_manifest")
LAG_COUNT_LIMIT = 100_000
BACKLOG_CHECK_S = 10.0  # how often the stream's unindexed backlog is compared with the alert


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
    shard_tokens: int = option(DEFAULT_SHARD_TOKENS, "largest shard, in tokens (the paper's 512M)")
    max_shards: int = option(8, "the datastore keeps at most max_shards x shard_tokens tokens; "
                             "beyond, the oldest shards leave the manifest")
    build_tokens: int = option(1_000_000, "build once this many new tokens are buffered ...")
    build_interval_s: float = option(60.0, "... or once the oldest buffered conversation is "
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
    ids: list[bytes] = field(default_factory=list)
    documents: list[list[int]] = field(default_factory=list)
    tokens: int = 0
    since: float | None = None  # monotonic time the oldest entry arrived

    def clear(self) -> None:
        self.ids, self.documents, self.tokens, self.since = [], [], 0, None


class Indexer:
    def __init__(self, config: IndexerConfig, crash_at: str | None = None) -> None:
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash_at must be one of {CRASH_POINTS}")
        self.config = config
        self.crash_at = crash_at
        self.directory = Path(config.datastore_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.client = connect(config.redis_url, socket_timeout=5.0, socket_connect_timeout=2.0)
        self.stats = IndexerStats()
        self._buffer = _Buffer()
        # Builds and merges both replace the manifest: each read-modify-write holds this lock.
        self._lock = threading.Lock()
        self._next_index = 0  # shard numbers handed out; names are never reused
        self._sizes: dict[str, int] = {}  # shard name -> tokens (shards are immutable)
        self._retired: list[tuple[float, str]] = []  # (monotonic time, shard) left out
        self._cleaned = False
        self._recovered = False
        self._merge_due = threading.Event()
        self._backlog_checked = 0.0

    # --- start-up -------------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        return read_manifest(self.directory) or EMPTY_MANIFEST

    def clean(self) -> None:
        """Removes what a crash left: unfinished shards and shards no manifest names. Only at
        start, before any build or merge of this process can have such a shard in progress."""
        if self._cleaned:
            return
        manifest = self.manifest
        for path in self.directory.glob(".shard-*.tmp"):  # a build or merge cut short
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed an unfinished shard %s", path.name)
        for path in self.directory.glob("shard-*"):  # built, but its manifest never written
            if path.is_dir() and path.name not in manifest.shards:
                shutil.rmtree(path, ignore_errors=True)
                logger.info("removed shard %s, which no manifest names", path.name)
        self._cleaned = True
        self._merge_due.set()  # shards left by a previous run may be due for a merge

    def recover(self) -> None:
        """Cleans up after a crash and takes back the entries never acknowledged."""
        import redis

        self.clean()
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

    # --- the loop ------------------------------------------------------------------------------

    def poll(self, block_ms: int | None = None) -> int:
        """Reads new entries (waiting up to block_ms), builds when due; returns entries read."""
        if not self._recovered:
            self.recover()
        batch = self.client.xreadgroup(
            self.config.group, self.config.consumer, {self.config.stream: ">"},
            count=self.config.read_count,
            block=self.config.block_ms if block_ms is None else block_ms)
        entries = batch[0][1] if batch else []
        dead = self.stats.dead_lettered
        self._take(entries)
        if self.maybe_build() is None and self.stats.dead_lettered != dead:
            self.trim()  # dead letters are acknowledged at once: trim them too
        if time.monotonic() - self._backlog_checked >= BACKLOG_CHECK_S:
            self.check_backlog()
        return len(entries)

    def run(self, stop: threading.Event) -> None:
        """Polls until `stop` is set; survives Redis outages (reconnects with backoff). Merges
        run in a background thread meanwhile."""
        import redis

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
                self.stats.redis_errors += 1
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

    @property
    def lag(self) -> int:
        """Stream entries not yet in the datastore: delivered but not acknowledged, plus not
        yet delivered (counted up to LAG_COUNT_LIMIT; Redis 6 has no XINFO lag field)."""
        group = self._group_info()
        if group is None:
            return -1
        last = group["last-delivered-id"]
        last = last.decode() if isinstance(last, bytes) else last
        undelivered = self.client.xrange(self.config.stream, min=f"({last}", max="+",
                                         count=LAG_COUNT_LIMIT)
        return int(group["pending"]) + len(undelivered)

    def _group_info(self) -> dict | None:
        for group in self.client.xinfo_groups(self.config.stream):
            name = group["name"]
            if (name.decode() if isinstance(name, bytes) else name) == self.config.group:
                return group
        return None

    # --- the stream's length ----------------------------------------------------------------------

    def trim(self) -> int:
        """Deletes the stream entries before the oldest one not yet indexed (pending in the
        group, or never delivered); returns how many. Never deletes an unindexed entry."""
        summary = self.client.xpending(self.config.stream, self.config.group)
        if summary["pending"]:
            oldest = summary["min"]
            oldest = oldest.decode() if isinstance(oldest, bytes) else oldest
        else:
            group = self._group_info()
            if group is None:
                return 0
            last = group["last-delivered-id"]
            milliseconds, sequence = entry_key(last)
            oldest = f"{milliseconds}-{sequence + 1}"  # everything delivered is indexed
        trimmed = int(self.client.xtrim(self.config.stream, minid=oldest, approximate=False))
        self.stats.trimmed += trimmed
        return trimmed

    def check_backlog(self) -> int:
        """Counts the unindexed entries; beyond `backlog_alert_entries` logs an alert (the
        stream keeps them: trimming waits for the indexer)."""
        self._backlog_checked = time.monotonic()
        backlog = self.lag
        if backlog >= self.config.backlog_alert_entries:
            self.stats.backlog_alerts += 1
            logger.warning("ALERT: %d stream entries are not indexed yet (alert at %d); the "
                           "stream keeps them until they are, and grows meanwhile", backlog,
                           self.config.backlog_alert_entries)
        return backlog

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
            if not fields:  # pending, but deleted from the stream (XDEL, a foreign trim)
                self._dead_letter(entry_id, {}, "entry deleted from the stream before it was "
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

    # --- shards -------------------------------------------------------------------------------

    def _allocate(self, manifest: Manifest) -> str:
        """A shard name never used here (the lock is held)."""
        index = max(self._next_index, next_shard_index(manifest, self.directory))
        self._next_index = index + 1
        return shard_name(index)

    def _size(self, name: str) -> int:
        if name not in self._sizes:
            self._sizes[name] = read_meta(self.directory / name).num_tokens
        return self._sizes[name]

    def _maybe_crash_writing(self, point: str, name: str, stream: np.ndarray) -> None:
        """At crash point `point` (tests): half of the shard's tokens written under its
        temporary name, then the 'death'."""
        if self.crash_at == point:
            partial = self.directory / f".{name}.crash.tmp"
            partial.mkdir()
            stream[: stream.shape[0] // 2].tofile(partial / "tokens.u32")
            raise SimulatedCrash(point)

    def _retire(self, names: list[str]) -> None:
        now = time.monotonic()
        self._retired += [(now, name) for name in names]
        keep = []
        for since, name in self._retired:
            # At least until the next manifest change, even with no grace at all.
            if now - since >= self.config.retire_grace_s and name not in names:
                shutil.rmtree(self.directory / name, ignore_errors=True)
                self._sizes.pop(name, None)
            else:
                keep.append((since, name))
        self._retired = keep

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
        """Indexes the buffer into new shards, publishes the manifest, then acknowledges."""
        start = time.perf_counter()
        config, buffer = self.config, self._buffer
        new_stream = make_stream(buffer.documents, config.vocab_size)
        first, last = buffer.ids[0].decode(), buffer.ids[-1].decode()
        with self._lock:
            manifest = self.manifest
            names = list(manifest.shards)
            for stream in _split(new_stream, config.shard_tokens):
                name = self._allocate(manifest)
                self._maybe_crash_writing("during_build", name, stream)
                write_shard(self.directory / name, stream, config.vocab_size,
                            config.tokenizer_fingerprint, source_first=first, source_last=last,
                            origin="model")  # conversations the served model answered
                self._sizes[name] = int(stream.shape[0])
                names.append(name)
            if self.crash_at == "after_build":
                raise SimulatedCrash("after_build")
            dropped = keep_newest([self._size(n) for n in names],
                                  config.max_shards * config.shard_tokens)
            retired, names = names[:dropped], names[dropped:]
            new_manifest = manifest.next(tuple(names), last)
            write_manifest(self.directory, new_manifest)
            if self.crash_at == "after_manifest":
                raise SimulatedCrash("after_manifest")
            self._retire(retired)
        # The entries are in the datastore from here on: out of the buffer before anything
        # else can fail, so a Redis error below never gets them indexed twice (the ones left
        # unacknowledged come back on reconnect and are only acknowledged, see _take).
        ids, tokens = buffer.ids, buffer.tokens
        buffer.clear()
        self._merge_due.set()
        self.stats.builds += 1
        self.stats.entries_indexed += len(ids)
        self.stats.tokens_indexed += tokens
        self.stats.last_build_s = time.perf_counter() - start
        logger.info("manifest v%d: %d shards, +%d entries (%d tokens) up to %s in %.2f s",
                    new_manifest.version, len(names), len(ids), tokens, last,
                    self.stats.last_build_s)
        self.client.xack(config.stream, config.group, *ids)
        self.trim()
        return new_manifest

    # --- merging ------------------------------------------------------------------------------

    def merge_once(self) -> Manifest | None:
        """Merges one run of same-tier shards if one is due (compaction.py) and publishes the
        manifest with the merged shard in their place; None when nothing is due. The heavy
        part (the suffix array) runs without the lock, so builds go on meanwhile."""
        config = self.config
        with self._lock:
            manifest = self.manifest
            sizes = [self._size(name) for name in manifest.shards]
            run = plan_merge(sizes, config.merge_base_tokens, config.merge_fanout,
                             config.shard_tokens)
            if run is None:
                return None
            sources = list(manifest.shards[run[0]:run[1]])
            name = self._allocate(manifest)
        start = time.perf_counter()
        metas = [read_meta(self.directory / source) for source in sources]
        merged = np.concatenate([np.fromfile(self.directory / source / "tokens.u32",
                                             dtype="<u4") for source in sources])
        self._maybe_crash_writing("during_merge", name, merged)
        # A merge keeps the weight only if every source is the model's text (a run that
        # includes a corpus shard is weighted like the corpus).
        origin = "model" if all(m.origin == "model" for m in metas) else "corpus"
        write_shard(self.directory / name, merged, config.vocab_size,
                    config.tokenizer_fingerprint, source_first=metas[0].source_first,
                    source_last=metas[-1].source_last, origin=origin)
        if self.crash_at == "after_merge_build":
            raise SimulatedCrash("after_merge_build")
        with self._lock:
            current = self.manifest  # builds may have added shards after the sources
            names = list(current.shards)
            at = _find_run(names, sources)
            if at is None:  # retention dropped some of them meanwhile: the merge is moot
                shutil.rmtree(self.directory / name, ignore_errors=True)
                return None
            names[at:at + len(sources)] = [name]
            self._sizes[name] = int(merged.shape[0])
            new_manifest = current.next(tuple(names), current.last_entry_id)
            write_manifest(self.directory, new_manifest)
            if self.crash_at == "after_merge_manifest":
                raise SimulatedCrash("after_merge_manifest")
            self._retire(sources)
        self.stats.merges += 1
        self.stats.tokens_merged += int(merged.shape[0])
        self.stats.last_merge_s = time.perf_counter() - start
        logger.info("manifest v%d: merged %d shards (%d tokens) into %s in %.2f s",
                    new_manifest.version, len(sources), merged.shape[0], name,
                    self.stats.last_merge_s)
        return new_manifest

    def merge_all(self) -> int:
        """Merges until nothing is due (tests, benchmarks); returns the number of merges."""
        count = 0
        while self.merge_once() is not None:
            count += 1
        return count


def _find_run(names: list[str], run: list[str]) -> int | None:
    """Where `run` sits, contiguous, in `names`; None if it does not."""
    if run[0] not in names:
        return None
    at = names.index(run[0])
    return at if names[at:at + len(run)] == run else None


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
