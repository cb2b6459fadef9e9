"""The decoder's matrix products y = x W^T (+ b), each weight kept in the layout its product
reads fastest on this CPU (kernel_paths.products chooses): sssd._kernels' panels (a step reads
them as one stream, at about the machine's read bandwidth from one row to sixteen, a row's
result independent of the rows beside it), the same panels on the AMX tile unit, oneDNN's
prepacked layout, or as given for `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sssd import _kernels
from sssd.common.model import kernel_paths
from sssd.common.model.kernel_paths import AMX_INPUTS

# The fewest rows a product prepacked for oneDNN runs on: oneDNN rounds a lone row differently
# from a batch's, and its kernels for 1-3 rows read the weights slower than its kernel for 4
# (bench/results/2026-11-25). The panels need no minimum.
MIN_PRODUCT_ROWS = 4


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out_features, in_features] as the panels of 64 outputs of sssd._kernels'
    products, the last panel's missing outputs zero: bfloat16 (linear_bf16) [num_panels,
    in_features / 2, 64, 2], float32 (linear_f32) [num_panels, in_features, 64]."""
    out_features, in_features = weight.shape
    num_panels = _kernels.packed_bf16_panels(out_features)
    padded = weight
    if num_panels * 64 != out_features:
        padded = torch.zeros(num_panels * 64, in_features, dtype=weight.dtype)
        padded[:out_features] = weight
    if weight.dtype == torch.float32:
        return padded.view(num_panels, 64, in_features).transpose(1, 2).contiguous()
    return padded.view(num_panels, 64, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


class Linear:
    """y = x W^T (+ b) for x [num_rows, in_features]. Where the weights are kept:
    - "panels": packed for sssd._kernels.linear_bf16 (bfloat16) or linear_f32 (float32), on a
      CPU with AVX-512 or with AVX2 and FMA;
    - "amx": the same panels, multiplied on the AMX tile unit (sssd._kernels.linear_bf16_amx;
      bfloat16, in_features a multiple of 32);
    - "onednn": prepacked for oneDNN (CPU, float32 or bfloat16);
    - "plain": as given, for `F.linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> None:
        # weight: [out_features, in_features]
        self.bias = None if bias is None else bias.contiguous()
        self.layout = layout
        self.out_features, self.in_features = weight.shape
        if layout == "panels":
            if weight.dtype not in (torch.bfloat16, torch.float32) or self.in_features % 2:
                raise ValueError(f"panels need a bfloat16 or float32 weight of an even width, "
                                 f"got {weight.dtype} {tuple(weight.shape)}")
            self.weight = pack_panels(weight.contiguous())
        elif layout == "amx":
            if not kernel_paths.cpu_features()["amx_bf16"]:
                raise ValueError("this CPU (or its OS) offers no AMX bfloat16 tiles")
            if weight.dtype != torch.bfloat16 or self.in_features % AMX_INPUTS:
                raise ValueError(f"AMX products need a bfloat16 weight whose width is a multiple "
                                 f"of {AMX_INPUTS}, got {weight.dtype} {tuple(weight.shape)}")
            self.weight = pack_panels(weight.contiguous())
        elif layout == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        elif layout == "plain":
            self.weight = weight
        else:
            raise ValueError(f"unknown weight layout {layout!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout in ("panels", "amx"):
            x = x.contiguous()
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            product = _kernels.linear_bf16_amx if self.layout == "amx" else \
                _kernels.linear_f32 if x.dtype == torch.float32 else _kernels.linear_bf16
            product(x.data_ptr(), self.weight.data_ptr(),
                    0 if self.bias is None else self.bias.data_ptr(), out.data_ptr(), x.shape[0],
                    self.in_features, self.out_features)
            return out
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
