"""Completed conversations as Redis stream entries, and their validation.

An entry's fields:
    prompt         prompt token ids, packed little-endian uint32
    output         output token ids, packed little-endian uint32
    fingerprint    the tokenizer fingerprint of the model that produced them
    finish_reason  "stop", "length", ...
    ts             seconds since the epoch (decimal text)
    uid            optional: the request's id; a conversation is published once per uid

Packed ids keep an entry about 4 bytes per token. `decode_entry` turns any entry into a
Conversation or raises MalformedEntry with the reason; the indexer dead-letters those.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np

STREAM = "sssd:conversations"
DEAD_LETTER_STREAM = "sssd:conversations:dead"
REQUIRED_FIELDS = ("prompt", "output", "fingerprint", "finish_reason", "ts")


class MalformedEntry(ValueError):
    """The entry cannot be indexed; the message is the reason recorded in the dead letter."""


@dataclass(frozen=True)
class Conversation:
    prompt_ids: list[int]
    output_ids: list[int]
    fingerprint: str
    finish_reason: str
    timestamp: float = field(default_factory=time.time)
    # The serving request's id: a publisher adds a uid to the stream at most once, so a retry
    # after an ambiguous Redis failure, or a request finished again after a failover, is not
    # indexed twice. "" (tests, offline tools): no such check.
    uid: str = ""

    @property
    def document(self) -> list[int]:
        """What goes into the datastore: the prompt followed by the answer."""
        return self.prompt_ids + self.output_ids

    def to_fields(self) -> dict[str, bytes]:
        return {
            "prompt": np.asarray(self.prompt_ids, dtype="<u4").tobytes(),
            "output": np.asarray(self.output_ids, dtype="<u4").tobytes(),
            "fingerprint": self.fingerprint.encode(),
            "finish_reason": self.finish_reason.encode(),
            "ts": repr(float(self.timestamp)).encode(),
        } | ({"uid": self.uid.encode()} if self.uid else {})

    def to_json(self) -> str:
        return json.dumps({"prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
                           "fingerprint": self.fingerprint,
                           "finish_reason": self.finish_reason, "timestamp": self.timestamp,
                           "uid": self.uid})

    @classmethod
    def from_json(cls, text: str) -> "Conversation":
        raw = json.loads(text)
        return cls([int(t) for t in raw["prompt_ids"]], [int(t) for t in raw["output_ids"]],
                   str(raw["fingerprint"]), str(raw["finish_reason"]), float(raw["timestamp"]),
                   str(raw.get("uid", "")))


def _ids(fields: dict[bytes, bytes], name: str, vocab_size: int) -> list[int]:
    raw = fields[name.encode()]
    if len(raw) % 4:
        raise MalformedEntry(f"{name}: {len(raw)} bytes is not a whole number of uint32 ids")
    ids = np.frombuffer(raw, dtype="<u4")
    if ids.size and int(ids.max()) >= vocab_size:
        raise MalformedEntry(f"{name}: token id {int(ids.max())} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return ids.astype(np.int64).tolist()


def decode_entry(fields: dict[bytes, bytes], vocab_size: int, fingerprint: str) -> Conversation:
    """The entry as a Conversation, or MalformedEntry naming what is wrong."""
    missing = [name for name in REQUIRED_FIELDS if name.encode() not in fields]
    if missing:
        raise MalformedEntry(f"missing fields: {', '.join(missing)}")
    try:
        entry_fingerprint = fields[b"fingerprint"].decode()
        finish_reason = fields[b"finish_reason"].decode()
        timestamp = float(fields[b"ts"].decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedEntry(f"unreadable field: {exc}") from exc
    if entry_fingerprint != fingerprint:
        raise MalformedEntry(f"tokenizer fingerprint {entry_fingerprint[:16]}... is not this "
                             f"datastore's {fingerprint[:16]}...")
    prompt = _ids(fields, "prompt", vocab_size)
    output = _ids(fields, "output", vocab_size)
    if not prompt and not output:
        raise MalformedEntry("no tokens")
    return Conversation(prompt, output, entry_fingerprint, finish_reason, timestamp)


def entry_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream id "ms-seq" as a comparable pair."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
