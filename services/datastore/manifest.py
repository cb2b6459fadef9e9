"""The datastore manifest: which shards are active, in order, and how far the stream is indexed.

`manifest.json` in the datastore directory is only ever replaced atomically (write a temporary
file, fsync, rename, fsync the directory), so a reader sees either the old or the new version,
never a mix, and a crash leaves one of the two on disk.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT_VERSION = 1


class ManifestError(ValueError):
    """The manifest exists but cannot be used (malformed, unknown format)."""


@dataclass(frozen=True)
class Manifest:
    version: int  # increases by one with every replacement
    shards: tuple[str, ...]  # shard directory names, oldest first
    # Id of the last stream entry whose tokens are in the shards (the indexer resumes after it).
    last_entry_id: str | None = None
    updated_at: float = field(default_factory=time.time)  # seconds since the epoch
    format_version: int = MANIFEST_FORMAT_VERSION

    def next(self, shards: tuple[str, ...], last_entry_id: str | None) -> "Manifest":
        return Manifest(version=self.version + 1, shards=shards, last_entry_id=last_entry_id)


EMPTY_MANIFEST = Manifest(version=0, shards=(), updated_at=0.0)


def manifest_path(datastore_dir: str | os.PathLike) -> Path:
    return Path(datastore_dir) / MANIFEST_NAME


def read_manifest(datastore_dir: str | os.PathLike) -> Manifest | None:
    """The current manifest, or None when the directory has none yet."""
    path = manifest_path(datastore_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(text)
        if raw.get("format_version") != MANIFEST_FORMAT_VERSION:
            raise ManifestError(
                f"{path}: format_version {raw.get('format_version')!r}, "
                f"this build reads {MANIFEST_FORMAT_VERSION}"
            )
        return Manifest(
            version=int(raw["version"]),
            shards=tuple(str(name) for name in raw["shards"]),
            last_entry_id=raw.get("last_entry_id"),
            updated_at=float(raw["updated_at"]),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ManifestError):
            raise
        raise ManifestError(f"{path}: malformed manifest: {exc}") from exc


def fsync_directory(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(datastore_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Replaces the manifest atomically and durably."""
    directory = Path(datastore_dir)
    directory.mkdir(parents=True, exist_ok=True)
    for name in manifest.shards:
        if not (directory / name).is_dir():
            raise ValueError(f"manifest names shard {name!r}, which is not in {directory}")
    payload = asdict(manifest)
    payload["shards"] = list(manifest.shards)
    temporary = directory / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, manifest_path(directory))
    fsync_directory(directory)
