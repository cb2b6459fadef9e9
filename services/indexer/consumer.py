"""The indexer's side of the conversation stream: a consumer group reader that hands on valid
conversations, dead-letters the rest, and trims only what is indexed.

Entries are acknowledged (XACK) only after the manifest that holds them is durable, and the
stream is trimmed up to the oldest entry not yet indexed (XTRIM MINID): nothing unindexed is
ever trimmed. Producers do not trim; a stream that grows past its alert length because the
indexer lags is reported (log, metric), never cut.

Entries that cannot be indexed (foreign tokenizer, ids outside the vocabulary, missing fields,
garbage) go to the dead-letter stream with the reason and the original fields, and are
acknowledged; they never stop the indexer. Entries at or before the manifest's last entry were
indexed by a build whose acknowledgement never happened (a crash): they are only acknowledged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

from sssd.common.conversations.record import MalformedEntry, decode_entry, entry_key

logger = logging.getLogger(__name__)

LAG_COUNT_LIMIT = 100_000
DEAD_LETTER_MAXLEN = 100_000
Entry = tuple[bytes, dict[bytes, bytes]]  # (entry id, fields) as XREADGROUP returns them


@dataclass
class ConsumerStats:
    dead_lettered: int = 0
    trimmed: int = 0  # stream entries deleted after they were indexed
    backlog_alerts: int = 0
    skipped_already_indexed: int = 0  # redelivered entries the manifest already holds


@dataclass(frozen=True)
class Document:
    """A conversation to index: its stream entry and its tokens (prompt, then answer)."""

    entry_id: bytes
    token_ids: list[int]


class StreamConsumer:
    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str,
                 dead_letter_stream: str, vocab_size: int, tokenizer_fingerprint: str,
                 read_count: int, backlog_alert_entries: int) -> None:
        self.client = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_letter_stream = dead_letter_stream
        self.vocab_size = vocab_size
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.read_count = read_count
        self.backlog_alert_entries = backlog_alert_entries
        self.stats = ConsumerStats()
        self.backlog_checked = 0.0  # monotonic time of the last backlog check

    def pending(self) -> list[Entry]:
        """Creates the consumer group if needed, then re-reads our pending entries: delivered
        before (to a process that died), never acknowledged."""
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        entries: list[Entry] = []
        start = "0"
        while True:
            batch = self.client.xreadgroup(self.group, self.consumer, {self.stream: start},
                                           count=self.read_count)
            page = batch[0][1] if batch else []
            if not page:
                return entries
            entries += page
            start = page[-1][0]

    def read(self, block_ms: int) -> list[Entry]:
        """New entries, waiting up to block_ms for some."""
        batch = self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                       count=self.read_count, block=block_ms)
        return batch[0][1] if batch else []

    def documents(self, entries: list[Entry], last_indexed: str | None) -> list[Document]:
        """The entries' conversations; the ones already in the datastore (at or before
        `last_indexed`) are acknowledged, malformed ones dead-lettered."""
        last_key = entry_key(last_indexed) if last_indexed else None
        documents = []
        for entry_id, fields in entries:
            if last_key is not None and entry_key(entry_id) <= last_key:
                self.acknowledge([entry_id])
                self.stats.skipped_already_indexed += 1
                continue
            if not fields:  # pending, but deleted from the stream (XDEL, a foreign trim)
                self._dead_letter(entry_id, {}, "entry deleted from the stream before it was "
                                  "indexed")
                continue
            try:
                conversation = decode_entry(fields, self.vocab_size, self.tokenizer_fingerprint)
            except MalformedEntry as exc:
                self._dead_letter(entry_id, fields, str(exc))
                continue
            documents.append(Document(entry_id, conversation.document))
        return documents

    def acknowledge(self, entry_ids: list[bytes]) -> None:
        if entry_ids:
            self.client.xack(self.stream, self.group, *entry_ids)

    def trim(self) -> int:
        """Deletes the stream entries before the oldest one not yet indexed (pending in the
        group, or never delivered); returns how many. Never deletes an unindexed entry."""
        summary = self.client.xpending(self.stream, self.group)
        if summary["pending"]:
            oldest = _text(summary["min"])
        else:
            group = self._group_info()
            if group is None:
                return 0
            milliseconds, sequence = entry_key(group["last-delivered-id"])
            oldest = f"{milliseconds}-{sequence + 1}"  # everything delivered is indexed
        trimmed = int(self.client.xtrim(self.stream, minid=oldest, approximate=False))
        self.stats.trimmed += trimmed
        return trimmed

    @property
    def lag(self) -> int:
        """Stream entries not yet in the datastore: delivered but not acknowledged, plus not
        yet delivered (counted up to LAG_COUNT_LIMIT; Redis 6 has no XINFO lag field)."""
        group = self._group_info()
        if group is None:
            return -1
        last = _text(group["last-delivered-id"])
        undelivered = self.client.xrange(self.stream, min=f"({last}", max="+",
                                         count=LAG_COUNT_LIMIT)
        return int(group["pending"]) + len(undelivered)

    def check_backlog(self) -> int:
        """Counts the unindexed entries; beyond `backlog_alert_entries` logs an alert (the
        stream keeps them: trimming waits for the indexer)."""
        self.backlog_checked = time.monotonic()
        backlog = self.lag
        if backlog >= self.backlog_alert_entries:
            self.stats.backlog_alerts += 1
            logger.warning("ALERT: %d stream entries are not indexed yet (alert at %d); the "
                           "stream keeps them until they are, and grows meanwhile", backlog,
                           self.backlog_alert_entries)
        return backlog

    def _group_info(self) -> dict | None:
        for group in self.client.xinfo_groups(self.stream):
            if _text(group["name"]) == self.group:
                return group
        return None

    def _dead_letter(self, entry_id: bytes, fields: dict[bytes, bytes], reason: str) -> None:
        letter = {b"reason": reason.encode(), b"entry_id": entry_id}
        letter.update({b"field:" + k: v for k, v in list(fields.items())[:32]})
        self.client.xadd(self.dead_letter_stream, letter, maxlen=DEAD_LETTER_MAXLEN,
                         approximate=True)
        self.acknowledge([entry_id])
        self.stats.dead_lettered += 1
        logger.warning("dead-lettered stream entry %s: %s", entry_id.decode(), reason)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
