"""The target model: a transformers causal LM on the CPU, with its tokenizer and stop tokens.

Converting the default GGUF (Q4_1) takes 12-17 s on the 2-core machines, mostly parsing the
GGUF metadata and de-quantizing; the converted weights are therefore saved once, in float32
safetensors, under the cache directory keyed by the GGUF file's sha256, and load from there in
0.3-0.6 s, tokenizer included (the first load in a process adds about 2 s of transformers' lazy
imports, cached or not). One float32 cache serves both dtypes: Q4_1 de-quantizes to float32, so
it holds the converted weights exactly, and casting it to bfloat16 at load gives bit-identical
weights to converting the GGUF straight to bfloat16. The cast costs about 0.25 s per bfloat16
load (0.35 s against 0.1 s from a bfloat16 copy), too little to be worth a second 270 MB cache
entry and a second conversion.

torch and transformers are imported when a model is loaded, not when this module is: the
configuration code that names `LoadedModel` or `ALLOWED_DTYPES` (frontends, the Helm chart's
checks) must not pay for them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sssd.common.model.device import resolve_device
from sssd.common.model.files import (
    MODELS,
    ModelFiles,
    cache_dir,
    file_sha256,
    is_complete,
    resolve_model,
    save_atomically,
)
from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ALLOWED_DTYPES = ("bfloat16", "float32")
# The dtype of the cached weights: what Q4_1 (and every GGUF block format) de-quantizes to.
_CACHE_DTYPE = "float32"
# Written last into a cache entry, so a half-written entry is never loaded.


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference: eval mode, no gradients, SDPA attention, on `device`."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    # tokenizer_fingerprint(tokenizer): datastores and drafters check it against their own.
    fingerprint: str
    # GGUF file stem or model directory name, for logs and metrics.
    name: str
    dtype: torch.dtype
    # Token ids that end a generation: the generation config's, plus the tokenizer's eos token.
    # SmolLM2-135M-Instruct: (2,), `<|im_end|>`, which closes every chat turn. Its
    # `<|endoftext|>` (id 0, also the unk token) is listed by neither, so plain `generate` does
    # not stop there either. `model.generation_config.eos_token_id` is set to these same ids.
    eos_token_ids: tuple[int, ...]
    # Width of the logits (rows of the output embedding). SmolLM2: 49152 == len(tokenizer).
    # Other models pad it (Qwen2.5: 151936 logits, 151665 tokens): ids at or above
    # len(tokenizer) are never drafted but can still receive probability mass.
    vocab_size: int
    # Wall-clock seconds of the whole load, tokenizer included.
    load_s: float
    # True when the weights came from the converted-weights cache rather than a conversion.
    from_cache: bool
    # Where the weights are: "cpu", "cuda:0", ... (device.resolve_device of the setting).
    device: str = "cpu"


def model_cache_dir(files: ModelFiles) -> Path:
    """Where the converted float32 weights of a GGUF model are (or will be) cached."""
    return cache_dir() / "models" / file_sha256(files.gguf_path)


def load_causal_lm(model: str | os.PathLike[str] | None = None,
                   dtype: str = "bfloat16", device: str = "cpu") -> LoadedModel:
    """Loads `model` (None: the default GGUF; a `.gguf` file; a Hugging Face model directory)
    onto `device` (a device setting: cpu, cuda, cuda:N, auto). The weights are read on the CPU
    and leave it once, whole.

    Raises FileNotFoundError for a path that does not exist, ValueError for a dtype other than
    ALLOWED_DTYPES, a directory without config.json, a file that is not a GGUF file, or a
    device this process does not have.
    """
    import torch  # see the module docstring: importing the loader loads no torch

    if dtype not in ALLOWED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {', '.join(ALLOWED_DTYPES)}")
    torch_device = resolve_device(device)  # before the load: a missing GPU fails at once
    torch_dtype = getattr(torch, dtype)
    start = time.perf_counter()
    files = _resolve(model)
    tokenizer = load_tokenizer(model)
    if files.is_gguf:
        lm, from_cache = _load_gguf(files, torch_dtype)
        name, source = Path(files.gguf_file).stem, files.gguf_path
    else:
        lm, from_cache = _from_pretrained(files.directory, torch_dtype), False
        name, source = files.directory.name, files.directory
    lm.eval()
    lm.requires_grad_(False)
    if torch_device.type != "cpu":
        lm.to(torch_device)

    eos_token_ids = _eos_token_ids(lm, tokenizer)
    lm.generation_config.eos_token_id = list(eos_token_ids) if len(eos_token_ids) > 1 \
        else eos_token_ids[0]
    vocab_size = lm.get_output_embeddings().weight.shape[0]
    if vocab_size != len(tokenizer):
        logger.info("%s: %d logits for %d tokenizer ids", name, vocab_size, len(tokenizer))
    load_s = time.perf_counter() - start
    logger.info("loaded %s in %s on %s from %s%s in %.2f s", name, dtype, torch_device, source,
                " (cached conversion)" if from_cache else "", load_s)
    return LoadedModel(model=lm, tokenizer=tokenizer, fingerprint=tokenizer_fingerprint(tokenizer),
                       name=name, dtype=torch_dtype, eos_token_ids=eos_token_ids,
                       vocab_size=vocab_size, load_s=load_s, from_cache=from_cache,
                       device=str(next(lm.parameters()).device))


def _resolve(model: str | os.PathLike[str] | None) -> ModelFiles:
    """resolve_model, with the errors of a model (not merely a tokenizer) location."""
    if model is not None and str(model) not in MODELS and not Path(model).expanduser().exists():
        raise FileNotFoundError(f"model path {str(model)!r} does not exist; pass a .gguf file, a "
                                "Hugging Face model directory, a name of `sssd-models list`, or "
                                "None for the default model")
    files = resolve_model(model)
    if not files.is_gguf and not (files.directory / "config.json").is_file():
        raise ValueError(f"{files.directory} has no config.json, so it is not a Hugging Face "
                         "model directory")
    return files


def _from_pretrained(directory: Path, dtype: torch.dtype) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM  # only when a model is loaded

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")


def _load_gguf(files: ModelFiles, dtype: torch.dtype) -> tuple[PreTrainedModel, bool]:
    """The model from the converted-weights cache, or converted (and cached) when cold."""
    import torch  # only when a model is loaded
    from transformers import AutoModelForCausalLM, GgufConfig

    cached = model_cache_dir(files)
    if is_complete(cached):
        return _from_pretrained(cached, dtype), True

    start = time.perf_counter()
    # dequantize=True: a plain dense model, which is what the cache stores, even where a GGUF
    # matmul kernel would let transformers keep the weights in their quantized blocks.
    lm = AutoModelForCausalLM.from_pretrained(
        files.directory, gguf_file=files.gguf_file, dtype=getattr(torch, _CACHE_DTYPE),
        attn_implementation="sdpa", quantization_config=GgufConfig(dequantize=True))
    logger.info("converted %s in %.2f s", files.gguf_path, time.perf_counter() - start)
    marker = json.dumps({"source": str(files.gguf_path), "dtype": _CACHE_DTYPE})
    if save_atomically(cached, lambda tmp: lm.save_pretrained(tmp, safe_serialization=True),
                       marker):
        logger.info("cached the converted weights of %s in %s", files.gguf_path, cached)
        # Load what every later process will load: a converted model cast with .to(dtype)
        # holds other non-persistent buffers (the rotary inv_freq is computed in float32 and
        # then rounded, where a model built in bfloat16 computes it differently), so in
        # bfloat16 the first process would decode differently from all later ones.
        return _from_pretrained(cached, dtype), False
    logger.warning("could not cache the converted weights in %s; outputs in %s may differ "
                   "slightly from a cached load's", cached, dtype)
    return lm.to(dtype), False


def _eos_token_ids(lm: PreTrainedModel,
                   tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The generation config's eos ids (an int or a list), then the tokenizer's, deduplicated."""
    configured = lm.generation_config.eos_token_id
    if configured is None:
        configured = lm.config.eos_token_id
    if configured is None:
        configured = []
    elif isinstance(configured, int):
        configured = [configured]
    ids = [*configured, tokenizer.eos_token_id]
    eos_token_ids = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
    if not eos_token_ids:
        raise ValueError("the model names no eos token in its generation config, config or "
                         "tokenizer, so a generation could never stop")
    return eos_token_ids
