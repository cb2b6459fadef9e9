"""Building datastores: documents of token ids -> shards + manifest (`sssd-build-datastore`);
hard-linked copies; reading the documents back."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from sssd.common.config.logs import configure_logging
from sssd.datastore.manifest import EMPTY_MANIFEST, Manifest, read_manifest, write_manifest
from sssd.datastore.shard import ORIGINS, SEPARATOR, make_stream, write_shard

logger = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 512 * 1024 * 1024  # the paper's sub-index size


def shard_name(index: int) -> str:
    return f"shard-{index:06d}"


def next_shard_index(manifest: Manifest, datastore_dir: Path) -> int:
    """One past the highest shard number ever used here, so names are never reused."""
    used = [int(p.name.split("-")[1]) for p in datastore_dir.glob("shard-*") if p.is_dir()
            and p.name.split("-")[1].isdigit()]
    used += [int(name.split("-")[1]) for name in manifest.shards]
    return max(used, default=-1) + 1


def _batches(
    documents: Iterable[Sequence[int] | np.ndarray], shard_tokens: int
) -> Iterator[list[np.ndarray]]:
    """Groups documents so that each group's stream (with separators) fits in shard_tokens."""
    batch: list[np.ndarray] = []
    size = 0
    for document in documents:
        tokens = np.asarray(document, dtype=np.int64)
        if tokens.size == 0:
            continue
        if tokens.size + 1 > shard_tokens:
            tokens = tokens[: shard_tokens - 1]  # a document never spans shards
        if size + tokens.size + 1 > shard_tokens and batch:
            yield batch
            batch, size = [], 0
        batch.append(tokens)
        size += tokens.size + 1
    if batch:
        yield batch


def build_datastore(
    datastore_dir: str | os.PathLike,
    documents: Iterable[Sequence[int] | np.ndarray],
    vocab_size: int,
    tokenizer_fingerprint: str,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    max_shards: int = 8,
    progress: bool = False,
    append: bool = False,
    origin: str = "corpus",
) -> Manifest:
    """Builds shards from `documents` into the datastore and publishes a new manifest.

    A directory that already holds a datastore is refused unless `append` is set: building
    into it again would silently add the corpus a second time. With `append` the new shards
    follow the existing ones; when more than `max_shards` would be active, the oldest are
    dropped from the manifest (their directories stay until removed by the operator or the
    indexer). `origin` goes into every new shard's meta.json ("corpus" or "model", see
    sssd.datastore.shard.ORIGINS).
    """
    if shard_tokens < 2:
        raise ValueError("shard_tokens must be >= 2")
    if max_shards < 1:
        raise ValueError("max_shards must be >= 1")
    directory = Path(datastore_dir)
    manifest = read_manifest(directory) if directory.is_dir() else None
    if manifest is not None and manifest.shards and not append:
        raise FileExistsError(
            f"{directory} already holds a datastore ({len(manifest.shards)} shards, manifest "
            f"v{manifest.version}); pass append=True (--append) to add to it, or choose an "
            "empty directory")
    directory.mkdir(parents=True, exist_ok=True)
    manifest = manifest or EMPTY_MANIFEST
    index = next_shard_index(manifest, directory)
    names = list(manifest.shards)
    bar = tqdm(desc="shards", unit="shard", disable=not progress)
    for batch in _batches(documents, shard_tokens):
        stream = make_stream(batch, vocab_size)
        name = shard_name(index)
        write_shard(directory / name, stream, vocab_size, tokenizer_fingerprint, origin=origin)
        logger.info("wrote %s: %d tokens, %d documents", name, stream.shape[0], len(batch))
        names.append(name)
        index += 1
        bar.update(1)
    bar.close()
    names = names[-max_shards:]
    new_manifest = manifest.next(tuple(names), manifest.last_entry_id)
    write_manifest(directory, new_manifest)
    return new_manifest


def link_datastore(source: str | os.PathLike, target: str | os.PathLike) -> Manifest:
    """Makes `target` a datastore with the same shards as `source`, hard-linking their files
    (shards are immutable, so sharing them is safe; copies when the two are on different file
    systems). For a live datastore that starts warm without touching the source."""
    source, target = Path(source), Path(target)
    manifest = read_manifest(source)
    if manifest is None or not manifest.shards:
        raise ValueError(f"{source} holds no datastore (no manifest listing shards)")
    target.mkdir(parents=True, exist_ok=True)
    for name in manifest.shards:
        if (target / name).exists():
            continue
        temporary = target / f".{name}.link.tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        for file in (source / name).iterdir():
            try:
                os.link(file, temporary / file.name)
            except OSError:
                shutil.copy2(file, temporary / file.name)
        os.rename(temporary, target / name)
    linked = Manifest(version=1, shards=manifest.shards, last_entry_id=None)
    write_manifest(target, linked)
    return linked


def read_documents(datastore_dir: str | os.PathLike) -> list[list[int]]:
    """Every document of the manifest's shards, oldest shard first (tests, tools)."""
    directory = Path(datastore_dir)
    manifest = read_manifest(directory) or EMPTY_MANIFEST
    documents = []
    for name in manifest.shards:
        stream = np.fromfile(directory / name / "tokens.u32", dtype="<u4")
        start = 0
        for end in np.flatnonzero(stream == SEPARATOR):
            documents.append(stream[start:end].astype(np.int64).tolist())
            start = end + 1
    return documents


# The JSONL forms `sssd-build-datastore` reads, one document per line.
DOCUMENT_FORMS = (
    "a list of token ids",
    '{"token_ids": [...]}',
    '{"prompt_ids": [...], "output_ids": [...]} (sssd-self-outputs; the document is the prompt '
    "followed by the answer; records with \"skipped\" are skipped)",
)


def document_of(record: object) -> list[int] | None:
    """The token ids of one JSONL record in one of DOCUMENT_FORMS; None for a record that says
    it holds none (a skipped self-output). Raises ValueError for anything else."""
    if isinstance(record, list):
        return record
    if isinstance(record, dict):
        if isinstance(record.get("token_ids"), list):
            return record["token_ids"]
        if isinstance(record.get("prompt_ids"), list) and isinstance(record.get("output_ids"),
                                                                     list):
            return record["prompt_ids"] + record["output_ids"]
        if "skipped" in record:
            return None
    raise ValueError("expected " + ", or ".join(DOCUMENT_FORMS))


def read_token_documents(path: Path) -> Iterator[list[int]]:
    """The documents of a JSONL file; a bad line raises ValueError naming it."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                document = document_of(json.loads(line))
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from exc
            if document is not None:
                yield document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sssd-build-datastore",
        description="Build datastore shards from a JSONL file of token-id documents and publish "
        "a new manifest. Each line is " + "; or ".join(DOCUMENT_FORMS) + ".",
    )
    parser.add_argument("datastore_dir", help="directory of manifest.json and the shards")
    parser.add_argument("input", type=Path, help="JSONL file of token-id documents")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--tokenizer-fingerprint", required=True)
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS})")
    parser.add_argument("--max-shards", type=int, default=8, help="active shards (default 8)")
    parser.add_argument("--append", action="store_true",
                        help="add to a datastore that already holds shards (default: refuse)")
    parser.add_argument("--origin", choices=ORIGINS, default="corpus",
                        help="'model' for conversations the served model answered (the drafter "
                        "weights them, see --model-shard-weight of sssd-drafter); default corpus")
    args = parser.parse_args(argv)
    configure_logging(logging.INFO)
    if not args.input.is_file():
        parser.error(f"{args.input} is not a file")
    try:
        manifest = build_datastore(
            args.datastore_dir, read_token_documents(args.input), args.vocab_size,
            args.tokenizer_fingerprint, args.shard_tokens, args.max_shards, progress=True,
            append=args.append, origin=args.origin,
        )
    except (ValueError, FileExistsError) as exc:
        print(f"sssd-build-datastore: error: {exc}", file=sys.stderr)
        return 1
    print(f"manifest v{manifest.version}: {len(manifest.shards)} shards in {args.datastore_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
