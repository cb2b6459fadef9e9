"""Decode workers' side of the live datastore: every completed conversation to the stream.

`ConversationSink` is an engine-loop observer. Each sequence a step finished normally ("stop" or
"length"; cancelled and failed requests never reach `StepOutput.finished`) is handed, prompt and
output token ids, to a `ConversationPublisher` (sssd.common.conversations.publisher), which never
blocks the loop.
"""

from __future__ import annotations

import os

from sssd.common.conversations.publisher import ConversationPublisher, PublishConfig
from sssd.common.conversations.record import Conversation
from sssd.verifier.engine.output import StepOutput
from sssd.verifier.serving.observers import LoopObserver


class ConversationSink(LoopObserver):
    def __init__(self, config: PublishConfig, fingerprint: str, worker: str = "local") -> None:
        self.fingerprint = fingerprint
        self.publisher = ConversationPublisher(
            config.redis_url, os.path.join(config.spool_dir, worker), stream=config.stream,
            alert_len=config.alert_len, spool_max_entries=config.spool_max_entries,
            password=config.password)

    def on_step(self, step: StepOutput, step_s: float) -> None:
        for seq in step.finished:
            # An answer decoded past EOS (ignore_eos, for benchmarks) is not one the model gave.
            if seq.output_ids and not seq.request.ignore_eos:
                self.publisher.publish(Conversation(list(seq.prompt_ids), list(seq.output_ids),
                                                    self.fingerprint, seq.finish_reason,
                                                    uid=seq.request_id))

    def close(self) -> None:
        self.publisher.close()
