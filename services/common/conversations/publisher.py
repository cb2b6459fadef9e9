"""Publishing completed conversations to the Redis stream without ever slowing a request.

`ConversationPublisher.publish` only puts the conversation on an in-memory queue (a full queue
goes to the disk spool instead) and returns. A background thread XADDs. It never trims the
stream: the indexer trims what it has indexed, so a lagging indexer never loses a conversation;
when the stream grows past `alert_len` entries the publisher logs an alert (and counts it).
While Redis is unreachable, conversations go to a bounded spool directory on disk (one small
file each, written to a temporary name and renamed, so a crash never leaves half a file);
once Redis answers again the spool is sent first, oldest first. When the spool is full the
oldest files are dropped and counted (`stats.dropped`). A spool left by a previous process is
sent by the next one that starts on the same directory.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from sssd.common.conversations.record import STREAM, Conversation
from sssd.common.conversations.redis_server import connect

logger = logging.getLogger(__name__)

LENGTH_CHECK_S = 10.0  # how often the stream's length is compared with alert_len
UID_TTL_S = 86_400  # how long a published uid is remembered (retries come within minutes)
# Adds the entry only if its uid was not published before, atomically: a retry of an XADD
# whose reply was lost (Redis died mid-call) finds the uid and adds nothing.
ADD_ONCE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
end
return false
"""


@dataclass(frozen=True)
class PublishConfig:
    """Where decode workers publish completed conversations (docs/services/indexer.md)."""

    redis_url: str
    spool_dir: str  # per worker: a subdirectory named after the worker is used
    stream: str = STREAM
    alert_len: int = 1_000_000  # a stream longer than this: the indexer lags, alert
    spool_max_entries: int = 100_000
    # Resolved where the configuration is made (the frontend) and carried to the workers with
    # it: a Ray worker's process may not have the frontend's environment (on Kubernetes it runs
    # in another pod). Never printed.
    password: str | None = field(default=None, repr=False)


@dataclass
class PublisherStats:
    published: int = 0  # entries added to the stream
    spooled: int = 0  # conversations written to the spool
    dropped: int = 0  # spooled conversations dropped because the spool was full
    backlog_alerts: int = 0  # times the stream was found longer than alert_len
    duplicates: int = 0  # conversations whose uid was already in the stream (not added again)
    redis_errors: int = 0


class Spool:
    """A directory of pending conversations, oldest first by name; at most `max_entries`."""

    SUFFIX = ".conv.json"

    def __init__(self, directory: str | os.PathLike, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("the spool needs room for at least one entry")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_entries = max_entries
        self._counter = itertools.count()
        self._lock = threading.Lock()
        for stale in self.directory.glob(".*.tmp"):  # a crash mid-write
            stale.unlink(missing_ok=True)

    def entries(self) -> list[Path]:
        return sorted(self.directory.glob("*" + self.SUFFIX))

    def __len__(self) -> int:
        return len(self.entries())

    def put(self, conversation: Conversation) -> int:
        """Writes one conversation; returns how many old ones were dropped to make room."""
        with self._lock:
            name = f"{time.time_ns():020d}-{os.getpid()}-{next(self._counter):08d}{self.SUFFIX}"
            temporary = self.directory / f".{name}.tmp"
            temporary.write_text(conversation.to_json())
            os.replace(temporary, self.directory / name)
            entries = self.entries()
            excess = entries[: max(0, len(entries) - self.max_entries)]
            for path in excess:
                path.unlink(missing_ok=True)
            return len(excess)

    def read(self, path: Path) -> Conversation | None:
        try:
            return Conversation.from_json(path.read_text())
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("dropping unreadable spool file %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return None


class ConversationPublisher:
    def __init__(self, redis_url: str, spool_dir: str | os.PathLike, stream: str = STREAM,
                 alert_len: int = 1_000_000, spool_max_entries: int = 100_000,
                 password: str | None = None,
                 queue_size: int = 10_000, retry_s: float = 0.5) -> None:
        extra = {"password": password} if password is not None else {}
        self.client = connect(redis_url, socket_timeout=2.0, socket_connect_timeout=1.0, **extra)
        self.stream = stream
        self.alert_len = alert_len
        self._add_once = self.client.register_script(ADD_ONCE)
        self._length_checked = 0.0
        self.spool = Spool(spool_dir, spool_max_entries)
        self.retry_s = retry_s
        self.stats = PublisherStats()
        self._queue: queue.Queue[Conversation] = queue.Queue(queue_size)
        self._stopping = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conversation-publisher",
                                        daemon=True)
        self._thread.start()

    # --- callers (decode workers) --------------------------------------------------------------

    def publish(self, conversation: Conversation) -> None:
        """Never blocks on Redis and never raises: queued, or spooled when the queue is full."""
        self._idle.clear()
        try:
            self._queue.put_nowait(conversation)
        except queue.Full:
            self._spool(conversation)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until everything queued and spooled is in the stream; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._idle.is_set() and self._queue.empty() and not len(self.spool):
                return True
            time.sleep(0.02)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what it can within the timeout; the rest is left in the spool on disk."""
        self.flush(timeout_s)
        self._stopping.set()
        self._thread.join(timeout_s)
        while True:  # whatever is still queued survives in the spool
            try:
                self._spool(self._queue.get_nowait())
            except queue.Empty:
                break
        self.client.close()

    # --- the background thread -------------------------------------------------------------------

    def _spool(self, conversation: Conversation) -> None:
        dropped = self.spool.put(conversation)
        self.stats.spooled += 1
        if dropped:
            self.stats.dropped += dropped
            logger.warning("conversation spool full: dropped the %d oldest", dropped)

    def _add(self, conversation: Conversation) -> None:
        if conversation.uid:
            fields = [item for pair in conversation.to_fields().items() for item in pair]
            added = self._add_once(keys=[self.stream, f"{self.stream}:uid:{conversation.uid}"],
                                   args=[UID_TTL_S, *fields])
            if not added:
                self.stats.duplicates += 1
                return
        else:
            self.client.xadd(self.stream, conversation.to_fields())
        self.stats.published += 1
        now = time.monotonic()
        if now - self._length_checked >= LENGTH_CHECK_S:
            self._length_checked = now
            length = self.client.xlen(self.stream)
            if length > self.alert_len:
                self.stats.backlog_alerts += 1
                logger.warning("ALERT: stream %s holds %d entries (alert at %d): the indexer is "
                               "behind or down; nothing is trimmed until it has indexed them",
                               self.stream, length, self.alert_len)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                for path in self.spool.entries():  # the backlog first, oldest first
                    conversation = self.spool.read(path)
                    if conversation is not None:
                        self._add(conversation)
                        path.unlink(missing_ok=True)
                try:
                    conversation = self._queue.get(timeout=0.1)
                except queue.Empty:
                    self._idle.set()
                    continue
                try:
                    self._add(conversation)
                except redis.RedisError:
                    self._spool(conversation)
                    raise
            except redis.RedisError as exc:
                self.stats.redis_errors += 1
                logger.warning("Redis unavailable (%s); spooling conversations to %s", exc,
                               self.spool.directory)
                # Move whatever is queued to disk, then wait before trying Redis again.
                while True:
                    try:
                        self._spool(self._queue.get_nowait())
                    except queue.Empty:
                        break
                self._idle.set()
                self._stopping.wait(self.retry_s)
