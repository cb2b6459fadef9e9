"""The live set of shards a drafter serves, and the watcher that swaps in new manifests.

Requests read `DatastoreWatcher.current` once per call; a swap replaces that reference, so a call
in flight keeps the shards it started with (their memory maps stay open until it returns), and
no request ever waits for a load.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from sssd import _core
from sssd.datastore.manifest import Manifest, ManifestError, read_manifest
from sssd.datastore.shard import LoadedShard, ShardError, load_shard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedDatastore:
    manifest: Manifest
    shards: tuple[LoadedShard, ...]
    core: _core.Datastore

    @property
    def num_tokens(self) -> int:
        return sum(shard.meta.num_tokens for shard in self.shards)


def load_datastore(
    datastore_dir: str | os.PathLike,
    manifest: Manifest,
    vocab_size: int,
    max_continuations: int,
    tokenizer_fingerprint: str | None = None,
    verify_checksums: bool = True,
    reuse: dict[str, LoadedShard] | None = None,
    model_shard_weight: int = 1,
) -> LoadedDatastore:
    """Loads every shard the manifest lists; raises ShardError if any one is unusable.

    Shards are immutable, so those already mapped (`reuse`, by name) are not verified again.
    Shards of the served model's own text (origin "model") get `model_shard_weight`, the
    others 1 (docs/algorithm.md, "Shard weights"); weights are relative, so a datastore of model
    shards only gives them all 1.
    """
    reuse = reuse or {}
    shards = []
    for name in manifest.shards:
        if name in reuse:
            shards.append(reuse[name])
        else:
            shards.append(
                load_shard(Path(datastore_dir) / name, vocab_size, tokenizer_fingerprint,
                           verify_checksums)
            )
    weights = shard_weights(shards, model_shard_weight)
    core = _core.Datastore([s.core_view(w) for s, w in zip(shards, weights)], vocab_size,
                           max_continuations)
    return LoadedDatastore(manifest, tuple(shards), core)


def shard_weights(shards: list[LoadedShard] | tuple[LoadedShard, ...], model_shard_weight: int
                  ) -> list[int]:
    """`model_shard_weight` for shards of origin "model" when the datastore also holds corpus
    shards, else 1 (only their ratio means anything)."""
    if all(s.meta.origin == "model" for s in shards):
        return [1] * len(shards)
    return [model_shard_weight if s.meta.origin == "model" else 1 for s in shards]


class DatastoreWatcher:
    """Keeps the newest usable manifest loaded; a bad new version leaves the old one serving."""

    def __init__(
        self,
        datastore_dir: str | os.PathLike,
        vocab_size: int,
        max_continuations: int,
        tokenizer_fingerprint: str | None = None,
        verify_checksums: bool = True,
        poll_interval_s: float = 1.0,
        model_shard_weight: int = 1,
    ) -> None:
        self.datastore_dir = Path(datastore_dir)
        self._model_shard_weight = model_shard_weight
        self._vocab_size = vocab_size
        self._max_continuations = max_continuations
        self._fingerprint = tokenizer_fingerprint
        self._verify = verify_checksums
        self._poll_interval_s = poll_interval_s
        self.current: LoadedDatastore | None = None
        self.last_error: str | None = None
        self._rejected_version: int | None = None  # not retried until the manifest changes
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> bool:
        """Loads the manifest if it is newer than the one serving. True if a swap happened."""
        with self._refresh_lock:
            try:
                manifest = read_manifest(self.datastore_dir)
            except (ManifestError, OSError) as exc:
                self._reject(None, str(exc))
                return False
            current_version = self.current.manifest.version if self.current else -1
            if manifest is None or manifest.version <= current_version:
                return False
            if manifest.version == self._rejected_version:
                return False
            reuse = {s.name: s for s in self.current.shards} if self.current else {}
            try:
                loaded = load_datastore(
                    self.datastore_dir, manifest, self._vocab_size, self._max_continuations,
                    self._fingerprint, self._verify, reuse, self._model_shard_weight,
                )
            except (ShardError, OSError, ValueError) as exc:
                self._reject(manifest.version, str(exc))
                return False
            fingerprints = {shard.meta.tokenizer_fingerprint for shard in loaded.shards}
            if len(fingerprints) > 1:
                self._reject(manifest.version, "its shards were built with different tokenizers "
                             f"({', '.join(sorted(f[:12] for f in fingerprints))})")
                return False
            if self._fingerprint is None and fingerprints:
                # Started without one: the first datastore's tokenizer is the one served from
                # now on (a later shard of another is refused) and the one `info` reports, so
                # that a client checks it against its model's.
                self._fingerprint = fingerprints.pop()
            self.current = loaded
            self.last_error = None
            weighted = sum(w > 1 for w in shard_weights(loaded.shards, self._model_shard_weight))
            logger.info(
                "serving datastore manifest v%d: %d shards, %d tokens%s",
                manifest.version, len(loaded.shards), loaded.num_tokens,
                f" ({weighted} of the served model's text, weight {self._model_shard_weight})"
                if weighted else "",
            )
            return True

    @property
    def tokenizer_fingerprint(self) -> str | None:
        """The tokenizer whose shards are served: the configured one, else that of the first
        datastore loaded (None before it)."""
        return self._fingerprint

    def _reject(self, version: int | None, reason: str) -> None:
        if version is not None and version == self._rejected_version:
            return
        self._rejected_version = version
        self.last_error = reason
        serving = self.current.manifest.version if self.current else None
        logger.error("refused datastore update (still serving manifest v%s): %s", serving, reason)

    def start(self) -> None:
        """Loads what is there now, then polls in a daemon thread."""
        self.refresh()
        if self.current is None and self.last_error is None:
            # A cold start (a live datastore before its first shard) or a mistyped path: say
            # which, since both draft from the input trie alone.
            logger.warning("no datastore manifest in %s yet: drafting from each sequence's own "
                           "tokens until one appears", self.datastore_dir.resolve())
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="datastore-watcher",
                                            daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_interval_s):
            try:
                self.refresh()
            except Exception:  # the watcher must outlive any surprise; requests keep serving
                logger.exception("datastore refresh failed")

    def close(self) -> None:
        """Stops polling and releases the datastore's memory maps here, in the closing thread.

        Left to the garbage collector, the last reference can be dropped by a daemon thread
        (gRPC's server thread holds the servicer) while the interpreter is finalizing; unmapping
        releases the GIL, and a thread that takes it back during finalization is torn down
        through the extension's frames, which aborts the process.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._refresh_lock:
            self.current = None
