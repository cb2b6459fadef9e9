"""The model's tokenizer, its vocabulary fingerprint and size.

Converting the default GGUF's tokenizer takes about 6 s (transformers rebuilds it from the GGUF
metadata); the converted tokenizer is saved once under the cache directory, keyed by the GGUF
file's sha256, and loads from there in about 0.3 s (importing transformers adds about 2 s to
either).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sssd.common.model.files import (
    ModelFiles,
    cache_dir,
    file_sha256,
    is_complete,
    resolve_model,
    save_atomically,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Written last into a cache entry, so a half-written entry is never loaded.


class TokenTexts:
    """Each token's text decoded alone (special tokens too), as log-probabilities report it;
    cached per token id, since every answer asks for its tokens and their alternatives again."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def tokenizer_cache_dir(files: ModelFiles) -> Path:
    """Where the converted tokenizer of a GGUF model is (or will be) cached."""
    return cache_dir() / "tokenizers" / file_sha256(files.gguf_path)


def load_tokenizer(model: str | os.PathLike[str] | None = None,
                   use_cache: bool = True) -> PreTrainedTokenizerBase:
    """Loads the tokenizer of `model` (None: the default GGUF; a `.gguf` file; a model directory).

    A GGUF model's converted tokenizer is cached on disk (`use_cache`); a model directory is
    loaded directly, as it is already fast.
    """
    from transformers import AutoTokenizer  # 1 s of imports, only for who loads a tokenizer

    files = resolve_model(model)
    start = time.perf_counter()
    if not files.is_gguf:
        tokenizer = AutoTokenizer.from_pretrained(files.directory)
        logger.info("loaded the tokenizer of %s in %.2f s", files.directory,
                    time.perf_counter() - start)
        return tokenizer

    cached = tokenizer_cache_dir(files) if use_cache else None
    if cached is not None and is_complete(cached):
        tokenizer = AutoTokenizer.from_pretrained(cached)
        logger.info("loaded the cached tokenizer of %s from %s in %.2f s", files.gguf_path,
                    cached, time.perf_counter() - start)
        return tokenizer

    tokenizer = AutoTokenizer.from_pretrained(files.directory, **files.from_pretrained_kwargs())
    logger.info("converted the tokenizer of %s in %.2f s", files.gguf_path,
                time.perf_counter() - start)
    if cached is not None and save_atomically(cached, tokenizer.save_pretrained):
        logger.info("cached the converted tokenizer in %s", cached)
    return tokenizer


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 hex of the vocabulary: sorted (token, id) pairs plus the special tokens.

    Datastores record it so that a drafter never mixes token ids of different vocabularies. It
    is the same for the GGUF-converted tokenizer and for its cached copy.
    """
    vocab = sorted(tokenizer.get_vocab().items())
    special = dict(tokenizer.special_tokens_map)
    payload = json.dumps({"vocab": vocab, "special": special}, sort_keys=True,
                         ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
    """Number of token ids, added tokens included (`len(tokenizer)`)."""
    return len(tokenizer)
