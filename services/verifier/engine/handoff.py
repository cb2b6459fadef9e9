"""A prompt's KV cache on its way from a prefill worker to a decode worker.

The keys and values travel as numpy arrays, so Ray's object store carries them without pickling
their contents and a decode worker on the same node reads them in place from shared memory
(zero-copy); the only copy on the decode side is the one into its KV-cache slot. numpy has no
bfloat16, so bfloat16 tensors travel as their raw 16-bit patterns and are viewed back.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

_RAW_DTYPES = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass(frozen=True)
class PrefilledPrompt:
    keys: np.ndarray  # [num_layers, num_kv_heads, prompt_len, head_dim], raw bits of `dtype`
    values: np.ndarray  # same shape
    dtype: str  # torch dtype name of keys and values, e.g. "bfloat16"
    logits: np.ndarray  # [vocab_size] float32: the next-token logits after the prompt
    prefill_s: float = 0.0  # time of the prefill forward
    num_cached_tokens: int = 0  # leading tokens the prefill worker's prefix cache held

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor, logits: torch.Tensor,
                     prefill_s: float = 0.0, num_cached_tokens: int = 0) -> "PrefilledPrompt":
        """From tensors on any device: each comes to the host once (`cpu()` copies from a GPU
        and is a no-op on the CPU)."""
        raw = _RAW_DTYPES.get(keys.dtype)
        as_numpy = (lambda t: t.cpu().contiguous().view(raw).numpy()) if raw is not None \
            else (lambda t: t.cpu().contiguous().numpy())
        return cls(as_numpy(keys), as_numpy(values), str(keys.dtype).removeprefix("torch."),
                   logits.float().cpu().numpy(), prefill_s, num_cached_tokens)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """keys, values and logits as torch tensors viewing the same memory (no copy)."""
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown KV dtype {self.dtype!r}")
        with warnings.catch_warnings():
            # Arrays from the object store are read-only; they are only read from here.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            keys, values, logits = (torch.from_numpy(a) for a in (self.keys, self.values,
                                                                   self.logits))
        if dtype in _RAW_DTYPES:
            keys, values = keys.view(dtype), values.view(dtype)
        return keys, values, logits
