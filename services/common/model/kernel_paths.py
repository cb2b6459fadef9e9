"""Which implementation each CPU kernel of the forward pass runs in this process: the one module
that reads the CPU's features and names the chosen path for every kernel.

The C++ kernels choose theirs once (services/common/model/kernels/cpu_paths.cc): the tree
attention (avx512, avx2, portable; prompts are chains of tree nodes), its bfloat16 scores (amx,
dpbf16, avx512), the panel products (avx512, avx2, none) and the argmax (avx512, portable).
Here, the one choice made in Python: where the decoder keeps each matrix product's weights
(`products`: amx, panels, onednn or plain).

    >>> chosen()["tree_attention"]
    {'float32': 'avx512', 'bfloat16': 'avx512'}

Tests and benchmarks that compare paths override them with `forced(...)`, never beyond what the
CPU has (ValueError).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch

from sssd import _kernels

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # sssd._kernels' Dtype
KERNELS = (*_kernels.KERNELS, "products")
PRODUCTS = ("amx", "panels", "onednn", "plain")  # in the order a CPU prefers them
AMX_INPUTS = 32  # an AMX tile's inputs: linear_bf16_amx needs in_features a multiple of it

_forced_products: str | None = None


def cpu_features() -> dict[str, bool]:
    """avx2_fma, avx512, avx512_bf16, amx_bf16 (the last: granted by the OS too)."""
    return _kernels.cpu_features()


def path(kernel: str, dtype: torch.dtype) -> str:
    """The path a C++ kernel (one of sssd._kernels.KERNELS) runs for `dtype` now."""
    return _kernels.kernel_path(kernel, DTYPE_CODES[dtype])


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks a weight of this dtype on this CPU: its bfloat16 products need
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and on an AVX2-only CPU (AMD Zen 2 and 3, say) the
    prepacking raises instead."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def possible_products(dtype: torch.dtype, device: torch.device,
                      widths: Sequence[int] = ()) -> list[str]:
    """Every weight layout the decoder can use here, best first, for products whose input and
    output widths are `widths`: amx (the panels on the AMX tile unit: bfloat16, widths multiples
    of AMX_INPUTS), panels (sssd._kernels' own products: float32 or bfloat16, even widths),
    onednn (prepacked for oneDNN), plain (`F.linear`)."""
    if device.type != "cpu" or dtype not in DTYPE_CODES:
        return ["plain"]
    found = []
    panels = path("panels", dtype) != "none" and all(w % 2 == 0 for w in widths)
    if panels and dtype == torch.bfloat16 and cpu_features()["amx_bf16"] and \
            all(w % AMX_INPUTS == 0 for w in widths):
        found.append("amx")
    if panels:
        found.append("panels")
    if torch.backends.mkldnn.is_available() and _onednn_packs(dtype):
        found.append("onednn")
    return found + ["plain"]


def products(dtype: torch.dtype, device: torch.device, widths: Sequence[int] = ()) -> str:
    """The weight layout of the decoder's products: the forced one (`forced(products=...)`)
    where it is possible here, else the best possible one."""
    possible = possible_products(dtype, device, widths)
    if _forced_products is None:
        return possible[0]
    if _forced_products not in possible:
        raise ValueError(f"products {_forced_products!r} cannot run a {dtype} model of widths "
                         f"{tuple(widths)} here (possible: {', '.join(possible)})")
    return _forced_products


def chosen() -> dict[str, dict[str, str]]:
    """Per kernel, the path it runs for each dtype now (products: on the CPU, for widths that
    every layout takes)."""
    return {kernel: {str(dtype).removeprefix("torch."): (
        products(dtype, torch.device("cpu")) if kernel == "products" else path(kernel, dtype))
        for dtype in DTYPE_CODES} for kernel in KERNELS}


@contextlib.contextmanager
def forced(**paths: str) -> Iterator[None]:
    """Runs the body with the named kernels forced to those paths (tree_attention="avx2",
    products="onednn", ...), then as before. Raises ValueError for a kernel or path this CPU
    does not have. The settings are the process's: tests that use it run their engines inside
    the block."""
    global _forced_products
    unknown = set(paths) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    if "products" in paths and paths["products"] not in PRODUCTS:
        raise ValueError(f"products must be one of {PRODUCTS}, got {paths['products']!r}")
    if "products" in paths:
        # bfloat16 is the dtype every layout but plain can take, so a layout it cannot run (onednn
        # on an AVX2-only CPU) is one this CPU does not have; float32 is checked per Decoder.
        possible = possible_products(torch.bfloat16, torch.device("cpu"))
        if paths["products"] not in possible:
            raise ValueError(f"products {paths['products']!r} cannot run here "
                             f"(possible: {', '.join(possible)})")
    previous: dict[str, str] = {}
    previous_products = _forced_products
    try:
        for kernel, value in paths.items():
            if kernel == "products":
                _forced_products = value
            else:
                previous[kernel] = _kernels.force_path(kernel, value)
        yield
    finally:
        _forced_products = previous_products
        for kernel, value in previous.items():
            _kernels.force_path(kernel, value)
