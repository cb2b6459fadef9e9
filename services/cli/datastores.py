"""The datastores the command-line apps start from, found or built on first use.

    1. an explicit directory (it must hold a manifest listing shards, built with the model's
       tokenizer);
    2. else the largest `datastore-N` or `datastore-N+sharegptM` (the model's own answers, with
       ShareGPT beside them, made with `sssd-self-outputs`) in `var/self-outputs` or a
       directory of it (`var/self-outputs/<model>`, `sssd-self-outputs --model`) built with the
       model's tokenizer, if it holds at least MIN_SELF_OUTPUT_CONVERSATIONS conversations: a
       few dozen answers draft worse than ShareGPT's 12,000 conversations. Of two with as many
       answers, the one with ShareGPT beside them;
    3. else ShareGPT records [0, N) tokenized with the model's chat template into
       `$SSSD_DATA_DIR` (default var/demo-datastore), built once (about a minute).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from sssd.common.data.corpus import iter_conversation_token_ids, iter_sharegpt
from sssd.common.model.tokenizer import tokenizer_fingerprint, vocab_size
from sssd.datastore.build import build_datastore
from sssd.datastore.manifest import read_manifest
from sssd.datastore.shard import datastore_meta

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = "var/demo-datastore"
SELF_OUTPUTS_DIR = Path("var/self-outputs")
DEFAULT_SHAREGPT_RECORDS = 12_000
# Below this many conversations a self-output datastore loses to ShareGPT (the vLLM peer
# bench: 56 self-output conversations drafted 1.25 tokens per step, ShareGPT 1.46).
MIN_SELF_OUTPUT_CONVERSATIONS = 1_000


class NoDatastore(ValueError):
    """A directory that was named as a datastore holds none."""


def default_data_dir() -> Path:
    return Path(os.environ.get("SSSD_DATA_DIR") or DEFAULT_DATA_DIR)


def has_shards(directory: Path) -> bool:
    manifest = read_manifest(directory) if directory.is_dir() else None
    return bool(manifest is not None and manifest.shards)


def datastore_fingerprint(directory: Path) -> str | None:
    """The tokenizer fingerprint a datastore's shards were built with (None: no shards)."""
    meta = datastore_meta(directory)
    return None if meta is None else meta.tokenizer_fingerprint


def ensure_sharegpt_datastore(root: Path, tokenizer, num_records: int) -> Path:
    """The datastore of ShareGPT records [0, num_records), built on first use."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    directory = root / f"sharegpt-{num_records}-{fingerprint[:12]}"
    if has_shards(directory):
        logger.info("reusing the datastore in %s", directory)
        return directory
    if directory.exists():  # an interrupted build: no manifest yet
        shutil.rmtree(directory)
    start = time.perf_counter()
    records = tqdm(iter_sharegpt(0, num_records), total=num_records, desc="tokenizing ShareGPT",
                   unit="conv")
    documents = iter_conversation_token_ids(tokenizer, records)
    manifest = build_datastore(directory, documents, vocab_size(tokenizer), fingerprint)
    logger.info("built %s (%d shards) in %.1f s", directory, len(manifest.shards),
                time.perf_counter() - start)
    return directory


SELF_OUTPUT_NAME = re.compile(r"datastore-(\d+)(\+sharegpt\d+)?")


def largest_self_output_datastore(fingerprint: str) -> Path | None:
    """The largest `datastore-N[+sharegptM]` in SELF_OUTPUTS_DIR or a directory of it built
    with the tokenizer of `fingerprint`, if N >= MIN_SELF_OUTPUT_CONVERSATIONS; of two with the
    same N, the one with ShareGPT."""
    built = []  # ((answers, with ShareGPT), path)
    for path in [*SELF_OUTPUTS_DIR.glob("datastore-*"), *SELF_OUTPUTS_DIR.glob("*/datastore-*")]:
        name = SELF_OUTPUT_NAME.fullmatch(path.name)
        if name is not None and datastore_fingerprint(path) == fingerprint:
            built.append(((int(name.group(1)), name.group(2) is not None), path))
    if not built:
        return None
    (conversations, _), path = max(built, key=lambda entry: entry[0])
    if conversations < MIN_SELF_OUTPUT_CONVERSATIONS:
        logger.info("not serving %s: fewer than %d conversations (pass --datastore to use it)",
                    path, MIN_SELF_OUTPUT_CONVERSATIONS)
        return None
    return path


def pick_datastore(explicit: Path | None, tokenizer,
                   records: int = DEFAULT_SHAREGPT_RECORDS) -> Path:
    """The datastore to serve (see the module docstring); NoDatastore for an explicit
    directory without one, or with one of another tokenizer."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if explicit is not None:
        check_datastore(explicit, fingerprint)
        return explicit
    return largest_self_output_datastore(fingerprint) or \
        ensure_sharegpt_datastore(default_data_dir(), tokenizer, records)


def check_datastore(directory: Path, fingerprint: str) -> None:
    """NoDatastore unless `directory` holds shards built with the tokenizer of `fingerprint`."""
    built_with = datastore_fingerprint(directory)
    if built_with is None:
        raise NoDatastore(f"{directory} holds no datastore (no manifest.json listing shards)")
    if built_with != fingerprint:
        raise NoDatastore(f"{directory} was built with another tokenizer ({built_with[:12]}) "
                          f"than the model's ({fingerprint[:12]}): its drafts would be other "
                          "tokens, and a drafter refuses its shards (rebuild it with this "
                          "model's tokenizer; the fingerprint covers the special tokens as the "
                          "installed transformers reports them, so an upgrade can change it)")


def add_datastore_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--datastore and --records, the same in every command that picks a datastore."""
    parser.add_argument("--datastore", type=Path, default=None,
                        help="datastore to serve (default: the largest self-output datastore of at "
                        f"least {MIN_SELF_OUTPUT_CONVERSATIONS} conversations, else ShareGPT "
                        "built on first use)")
    parser.add_argument("--records", type=int, default=DEFAULT_SHAREGPT_RECORDS,
                        help="ShareGPT records for the first-run datastore (default "
                        f"{DEFAULT_SHAREGPT_RECORDS})")
