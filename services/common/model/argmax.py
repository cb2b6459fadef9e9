"""Greedy choices over logits: the first maximum of every row, as torch.argmax chooses it."""

from __future__ import annotations

import torch

from sssd import _kernels
from sssd.common.model.kernel_paths import DTYPE_CODES


def argmax_last(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the same indices (the first maximum; a NaN counts as the maximum),
    by sssd._kernels.argmax_rows where the logits are a CPU tensor of float32 or bfloat16 whose
    last dimension is contiguous: torch's argmax scans a bfloat16 row without vectorizing, which
    costs a verification step of many nodes more than the rest of its head."""
    code = DTYPE_CODES.get(logits.dtype)
    if logits.device.type != "cpu" or code is None or logits.dim() == 0 or \
            logits.shape[-1] == 0 or logits.stride(-1) != 1:
        return logits.argmax(-1)
    rows = logits.reshape(-1, logits.shape[-1])  # a view where the rows are evenly strided
    if rows.stride(0) != rows.shape[1]:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if rows.shape[0]:
        _kernels.argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], code, out.data_ptr())
    return out.reshape(logits.shape[:-1])
