"""The live datastore's directory: new shards from buffered conversations, retention of the
newest, and the bookkeeping a build and a merge share (shard names, sizes, retired shards).

Crash safety. Shards are written under a temporary name and renamed, and the manifest is
replaced atomically, so after a crash at any point of a build or a merge the directory holds
the old manifest or the new one. `clean` removes what a crash leaves behind: temporary
directories, and shards that no manifest names.

A build costs what its own tokens cost, whatever the size of the datastore: the buffered
documents become new small shards (several when they exceed `shard_tokens`); beyond
`max_tokens` the oldest shards leave the manifest. Shard directories no manifest names any more
are deleted `retire_grace_s` later (a drafter may still be switching away from them).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from sssd.datastore.build import next_shard_index, shard_name
from sssd.datastore.manifest import EMPTY_MANIFEST, Manifest, read_manifest, write_manifest
from sssd.datastore.shard import SEPARATOR, make_stream, read_meta, write_shard

logger = logging.getLogger(__name__)

# Where a build or a merge can be cut short: while a shard is written, after it is written,
# after the manifest is published. A fault hook (tests) is called at each of them with the
# shard's directory and tokens, and may raise there as a crash would.
FaultHook = Callable[[str, Path, np.ndarray], None]
BUILD_POINTS = ("during_build", "after_build", "after_manifest")


def no_fault(point: str, shard: Path, tokens: np.ndarray) -> None:
    pass


class ShardStore:
    """The live datastore's directory and the lock every manifest change holds."""

    def __init__(self, directory: str | Path, vocab_size: int, tokenizer_fingerprint: str,
                 shard_tokens: int, retire_grace_s: float, fault: FaultHook = no_fault) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.shard_tokens = shard_tokens
        self.retire_grace_s = retire_grace_s
        self.fault = fault
        # Builds and merges both replace the manifest: each read-modify-write holds this lock.
        self.lock = threading.Lock()
        self._next_index = 0  # shard numbers handed out; names are never reused
        self._sizes: dict[str, int] = {}  # shard name -> tokens (shards are immutable)
        self._retired: list[tuple[float, str]] = []  # (monotonic time, shard) left out

    @property
    def manifest(self) -> Manifest:
        return read_manifest(self.directory) or EMPTY_MANIFEST

    def clean(self) -> None:
        """Removes what a crash left: unfinished shards and shards no manifest names. Only at
        start, before any build or merge of this process can have such a shard in progress."""
        manifest = self.manifest
        for path in self.directory.glob(".shard-*.tmp"):  # a build or merge cut short
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed an unfinished shard %s", path.name)
        for path in self.directory.glob("shard-*"):  # built, but its manifest never written
            if path.is_dir() and path.name not in manifest.shards:
                shutil.rmtree(path, ignore_errors=True)
                logger.info("removed shard %s, which no manifest names", path.name)

    def build(self, documents: Sequence[Sequence[int]], first_entry: str, last_entry: str,
              max_tokens: int) -> tuple[Manifest, int]:
        """Writes the documents as new shards after the current ones, keeps the newest
        `max_tokens` tokens, and publishes the manifest naming `last_entry` as the last stream
        entry it holds. Returns the manifest and the number of shards it names."""
        new_stream = make_stream(documents, self.vocab_size)
        with self.lock:
            manifest = self.manifest
            names = list(manifest.shards)
            for stream in split_at_documents(new_stream, self.shard_tokens):
                name = self.allocate(manifest)
                self.fault("during_build", self.directory / name, stream)
                write_shard(self.directory / name, stream, self.vocab_size,
                            self.tokenizer_fingerprint, source_first=first_entry,
                            source_last=last_entry,
                            origin="model")  # conversations the served model answered
                self._sizes[name] = int(stream.shape[0])
                names.append(name)
            self.fault("after_build", self.directory, new_stream)
            dropped = keep_newest([self.size(n) for n in names], max_tokens)
            retired, names = names[:dropped], names[dropped:]
            new_manifest = manifest.next(tuple(names), last_entry)
            write_manifest(self.directory, new_manifest)
            self.fault("after_manifest", self.directory, new_stream)
            self.retire(retired)
        return new_manifest, len(names)

    # --- bookkeeping shared with the compactor (the lock is held) ------------------------------

    def allocate(self, manifest: Manifest) -> str:
        """A shard name never used here."""
        index = max(self._next_index, next_shard_index(manifest, self.directory))
        self._next_index = index + 1
        return shard_name(index)

    def size(self, name: str) -> int:
        if name not in self._sizes:
            self._sizes[name] = read_meta(self.directory / name).num_tokens
        return self._sizes[name]

    def record_size(self, name: str, num_tokens: int) -> None:
        self._sizes[name] = num_tokens

    def retire(self, names: list[str]) -> None:
        """Shards that left the manifest, deleted once `retire_grace_s` has passed."""
        now = time.monotonic()
        self._retired += [(now, name) for name in names]
        keep = []
        for since, name in self._retired:
            # At least until the next manifest change, even with no grace at all.
            if now - since >= self.retire_grace_s and name not in names:
                shutil.rmtree(self.directory / name, ignore_errors=True)
                self._sizes.pop(name, None)
            else:
                keep.append((since, name))
        self._retired = keep


def keep_newest(sizes: Sequence[int], max_tokens: int) -> int:
    """How many of the oldest shards leave so that the rest hold at most `max_tokens` tokens
    (the newest shard always stays)."""
    total, drop = sum(sizes), 0
    while drop < len(sizes) - 1 and total > max_tokens:
        total -= sizes[drop]
        drop += 1
    return drop


def split_at_documents(stream: np.ndarray, shard_tokens: int) -> Iterator[np.ndarray]:
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
