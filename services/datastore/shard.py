"""Datastore shards on disk: build, write, verify and memory-map (docs/algorithm.md).

A shard is a directory that is written once and never modified:

    tokens.u32   the token stream: whole documents, each followed by 0xFFFFFFFF (uint32 LE)
    sa.u32       its suffix array (uint32 LE), built by SA-IS in the C++ core
    buckets.u32  first-token index: vocab_size + 2 row offsets into the suffix array (uint32 LE)
    meta.json    counts, vocabulary size, tokenizer fingerprint, sha256 of each file, the range
                 of source entries it holds, creation time, origin (an offline corpus, or the
                 served model's own text, which the drafter weights higher: docs/algorithm.md)

Loading memory-maps the three arrays read-only: nothing is copied to the heap, and several drafter
processes share the page cache. A shard is written into a temporary directory and renamed into
place, so a half-written shard never has its final name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from sssd.datastore.manifest import fsync_directory

logger = logging.getLogger(__name__)

SHARD_FORMAT_VERSION = 1
# Ends every document in a stream; equals the C++ core's DOCUMENT_SEPARATOR (tested).
SEPARATOR = np.uint32(0xFFFFFFFF)
ARRAY_FILES = ("tokens.u32", "sa.u32", "buckets.u32")
# "corpus": text from elsewhere (ShareGPT, a user's files); "model": conversations the served
# model answered (the live datastore, sssd-self-outputs), weighted by the drafter.
ORIGINS = ("corpus", "model")
META_NAME = "meta.json"
MAX_SHARD_TOKENS = (1 << 31) - 2

if sys.byteorder != "little":  # the files are little-endian and mapped without conversion
    raise ImportError("sssd shards are memory-mapped as little-endian arrays")


class ShardError(ValueError):
    """A shard that cannot be used: missing files, wrong sizes, bad checksum, foreign tokenizer."""


@dataclass(frozen=True)
class ShardMeta:
    num_tokens: int  # stream length, separators included
    num_documents: int
    vocab_size: int
    tokenizer_fingerprint: str
    checksums: dict[str, str]  # file name -> sha256 hex
    source_first: str | None = None  # first source entry held (e.g. a Redis stream id)
    source_last: str | None = None  # last source entry held
    created_at: float = 0.0  # seconds since the epoch
    format_version: int = SHARD_FORMAT_VERSION
    origin: str = "corpus"  # one of ORIGINS; shards written before the field are "corpus"


@dataclass(frozen=True)
class LoadedShard:
    name: str  # directory name, as listed in the manifest
    meta: ShardMeta
    stream: np.ndarray  # [num_tokens] uint32, memory-mapped
    suffix_array: np.ndarray  # [num_tokens] uint32, memory-mapped
    bucket_starts: np.ndarray  # [vocab_size + 2] uint32, memory-mapped

    def core_view(self, weight: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """What `_core.Datastore` takes for this shard, with its weight (docs/algorithm.md)."""
        return self.stream, self.suffix_array, self.bucket_starts, weight


def make_stream(documents: Iterable[Sequence[int] | np.ndarray], vocab_size: int) -> np.ndarray:
    """[num_tokens] uint32: the documents, each followed by the separator. Empty ones are skipped.

    Raises ValueError naming the first document with a token outside [0, vocab_size).
    """
    parts: list[np.ndarray] = []
    separator = np.array([SEPARATOR], dtype=np.uint32)
    for index, document in enumerate(documents):
        tokens = np.asarray(document, dtype=np.int64)
        if tokens.size == 0:
            continue
        if tokens.ndim != 1:
            raise ValueError(f"document {index} is not a flat list of token ids")
        if tokens.min() < 0 or tokens.max() >= vocab_size:
            bad = int(tokens[(tokens < 0) | (tokens >= vocab_size)][0])
            raise ValueError(
                f"document {index} has token id {bad}, outside the vocabulary [0, {vocab_size})"
            )
        parts.append(tokens.astype(np.uint32))
        parts.append(separator)
    if not parts:
        return np.empty(0, dtype=np.uint32)
    return np.concatenate(parts)


def bucket_starts(stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """[vocab_size + 2] uint32: first suffix-array row of each first token, then separators."""
    is_separator = stream == SEPARATOR
    counts = np.bincount(stream[~is_separator].astype(np.int64), minlength=vocab_size)
    starts = np.zeros(vocab_size + 2, dtype=np.uint64)
    np.cumsum(counts, out=starts[1 : vocab_size + 1])
    starts[vocab_size + 1] = stream.shape[0]
    return starts.astype(np.uint32)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_array(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        array.astype("<u4", copy=False).tofile(f)
        f.flush()
        os.fsync(f.fileno())


def write_shard(
    directory: str | os.PathLike,
    stream: np.ndarray,
    vocab_size: int,
    tokenizer_fingerprint: str,
    source_first: str | None = None,
    source_last: str | None = None,
    origin: str = "corpus",
) -> ShardMeta:
    """Builds the suffix array of `stream` and writes the shard to `directory` (must not exist)."""
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
    final = Path(directory)
    if final.exists():
        raise FileExistsError(f"{final} exists; shards are immutable, write a new directory")
    if stream.dtype != np.uint32 or stream.ndim != 1:
        raise ValueError("stream must be a flat uint32 array (see make_stream)")
    if stream.shape[0] == 0:
        raise ValueError("a shard needs at least one non-empty document")
    if stream.shape[0] > MAX_SHARD_TOKENS:
        raise ValueError(f"a shard holds at most {MAX_SHARD_TOKENS} tokens")
    if stream[-1] != SEPARATOR:
        raise ValueError("the stream must end with a document separator (see make_stream)")

    from sssd import _core  # the C++ core builds the suffix array (SA-IS)

    suffix_array = _core.build_suffix_array(stream, vocab_size)
    starts = bucket_starts(stream, vocab_size)

    temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir(parents=True)
    checksums = {}
    for name, array in zip(ARRAY_FILES, (stream, suffix_array, starts)):
        _write_array(temporary / name, array)
        checksums[name] = file_sha256(temporary / name)
    meta = ShardMeta(
        num_tokens=int(stream.shape[0]),
        num_documents=int(np.count_nonzero(stream == SEPARATOR)),
        vocab_size=vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint,
        checksums=checksums,
        source_first=source_first,
        source_last=source_last,
        created_at=time.time(),
        origin=origin,
    )
    with open(temporary / META_NAME, "w") as f:
        json.dump(asdict(meta), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(temporary)
    os.rename(temporary, final)
    fsync_directory(final.parent)
    return meta


def read_meta(directory: str | os.PathLike) -> ShardMeta:
    path = Path(directory) / META_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ShardError(f"{directory}: no {META_NAME}") from exc
    except json.JSONDecodeError as exc:
        raise ShardError(f"{path}: malformed JSON: {exc}") from exc
    if raw.get("format_version") != SHARD_FORMAT_VERSION:
        raise ShardError(
            f"{path}: format_version {raw.get('format_version')!r}, "
            f"this build reads {SHARD_FORMAT_VERSION}"
        )
    try:
        meta = ShardMeta(**raw)
    except TypeError as exc:
        raise ShardError(f"{path}: unexpected fields: {exc}") from exc
    if meta.origin not in ORIGINS:
        raise ShardError(f"{path}: origin {meta.origin!r}, expected one of {ORIGINS}")
    return meta


def load_shard(
    directory: str | os.PathLike,
    vocab_size: int | None = None,
    tokenizer_fingerprint: str | None = None,
    verify_checksums: bool = True,
) -> LoadedShard:
    """Verifies a shard and memory-maps its arrays. Raises ShardError with the reason."""
    directory = Path(directory)
    meta = read_meta(directory)
    if vocab_size is not None and meta.vocab_size != vocab_size:
        raise ShardError(
            f"{directory}: built for vocab_size {meta.vocab_size}, the drafter serves {vocab_size}"
        )
    if tokenizer_fingerprint is not None and meta.tokenizer_fingerprint != tokenizer_fingerprint:
        raise ShardError(
            f"{directory}: built with tokenizer {meta.tokenizer_fingerprint[:12]}, "
            f"the drafter serves {tokenizer_fingerprint[:12]}"
        )
    expected_lengths = {
        "tokens.u32": meta.num_tokens,
        "sa.u32": meta.num_tokens,
        "buckets.u32": meta.vocab_size + 2,
    }
    arrays = []
    for name in ARRAY_FILES:
        path = directory / name
        if not path.is_file():
            raise ShardError(f"{directory}: missing {name}")
        size = path.stat().st_size
        if size != 4 * expected_lengths[name]:
            raise ShardError(
                f"{path}: {size} bytes, expected {4 * expected_lengths[name]} (truncated or "
                "foreign)"
            )
        if verify_checksums:
            digest = file_sha256(path)
            if digest != meta.checksums.get(name):
                raise ShardError(f"{path}: sha256 {digest[:12]} does not match meta.json")
        arrays.append(np.memmap(path, dtype="<u4", mode="r", shape=(expected_lengths[name],)))
    stream, suffix_array, starts = arrays
    if meta.num_tokens == 0 or stream[-1] != SEPARATOR:
        raise ShardError(f"{directory}: the token stream does not end with a document separator")
    if int(starts[-1]) != meta.num_tokens:
        raise ShardError(f"{directory}: the bucket index does not end at num_tokens")
    return LoadedShard(directory.name, meta, stream, suffix_array, starts)


def datastore_meta(datastore_dir: str | os.PathLike) -> ShardMeta | None:
    """What the datastore's shards were built with (its first shard's meta: the tokenizer
    fingerprint and the vocabulary, which a drafter must be started with; one started for
    another refuses them), or None for a directory without a datastore of shards."""
    from sssd.datastore.manifest import read_manifest

    directory = Path(datastore_dir)
    manifest = read_manifest(directory) if directory.is_dir() else None
    if manifest is None or not manifest.shards:
        return None
    return read_meta(directory / manifest.shards[0])
