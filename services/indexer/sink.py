"""Decode workers' side of the live datastore: every completed conversation to the stream.

`ConversationSink` is an engine-loop observer. When a request ends normally ("stop" or
"length"; not cancelled, not failed) it hands the prompt and output token ids to a
`ConversationPublisher`, which never blocks the loop (producer.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sssd.indexer.conversations import STREAM, Conversation
from sssd.verifier.loop import LoopObserver
from sssd.verifier.totals import Totals

PUBLISHED_REASONS = ("stop", "length")


@dataclass(frozen=True)
class PublishConfig:
    redis_url: str
    spool_dir: str  # per worker: a subdirectory named after the worker is used
    stream: str = STREAM
    maxlen: int = 1_000_000  # approximate trimming of the stream
    spool_max_entries: int = 100_000


class ConversationSink(LoopObserver):
    def __init__(self, config: PublishConfig, fingerprint: str, worker: str = "local") -> None:
        from sssd.indexer.producer import ConversationPublisher

        self.fingerprint = fingerprint
        self.publisher = ConversationPublisher(
            config.redis_url, os.path.join(config.spool_dir, worker), stream=config.stream,
            maxlen=config.maxlen, spool_max_entries=config.spool_max_entries)

    def on_finish(self, totals: Totals | None, error: str | None, seq=None) -> None:
        if totals is None or seq is None or totals.finish_reason not in PUBLISHED_REASONS:
            return
        if not seq.output_ids:
            return
        self.publisher.publish(Conversation(list(seq.prompt_ids), list(seq.output_ids),
                                            self.fingerprint, totals.finish_reason))

    def close(self) -> None:
        self.publisher.close()
