"""The packed weights in one buffer of 2 MiB pages.

A decode step streams every weight once. With 4 KiB pages that is a TLB miss and a page walk
every 4 KiB: 70,000 of them a step for SmolLM2-135M's 270 MB, 770,000 for Qwen2.5-1.5B. Linux
backs memory with 2 MiB pages where a program asks (transparent huge pages in `madvise` mode,
the default of many distributions) or everywhere (`always`), but only in 2 MiB-aligned runs of
a mapping, and most of a small model's matrices are smaller than one such page. So the decoder
copies its packed weights one after another into one buffer whose 2 MiB-aligned interior it
advises (MADV_HUGEPAGE) before the copy touches it.

The engine against the same engine on 4 KiB pages (`bench/engine_speed.py --systems
engine,engine-4k`): bench/results/2026-11-28-epyc-5, a gain on the 1.5B model and within the
noise on the small one. Where the OS refuses or lacks the advice
(another OS, THP `never`) the buffer is ordinary memory and everything works as before;
SSSD_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB granule) transparent huge page
ALIGN = 64  # bytes: each weight starts on a cache line
MADV_HUGEPAGE = 14  # <linux/mman.h>
ENV = "SSSD_HUGE_PAGES"


def enabled() -> bool:
    """False on other systems than Linux and where SSSD_HUGE_PAGES is 0 (or false, no, off)."""
    return sys.platform.startswith("linux") and \
        os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _advise(address: int, length: int) -> bool:
    """Asks the kernel for huge pages over [address, address + length); True when it agreed."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    if madvise(address, length, MADV_HUGEPAGE) != 0:
        logger.info("madvise(MADV_HUGEPAGE) refused (%s): the weights stay on ordinary pages",
                    os.strerror(ctypes.get_errno()))
        return False
    return True


def _aligned(num_bytes: int, alignment: int) -> int:
    return -(-num_bytes // alignment) * alignment


def empty_on_huge_pages(num_bytes: int) -> torch.Tensor:
    """`num_bytes` of uninitialised uint8 memory starting on a 2 MiB boundary, advised for huge
    pages (kept on ordinary pages where the OS refuses). A fresh anonymous mapping: none of its
    pages is touched yet, so each first touch faults in a huge page (memory from malloc may be
    reused pages, already 4 KiB ones)."""
    advised = _aligned(num_bytes, HUGE_PAGE)  # whole huge pages, from the first 2 MiB boundary
    mapping = torch.frombuffer(mmap.mmap(
        -1, advised + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    start = _aligned(mapping.data_ptr(), HUGE_PAGE) - mapping.data_ptr()
    _advise(mapping.data_ptr() + start, advised)
    return mapping[start:start + num_bytes]


def move_into_huge_pages(holders: list) -> None:
    """Moves each holder's `weight` (a contiguous CPU tensor) into one buffer of
    `empty_on_huge_pages`, in order, each starting on a cache line; the new `weight` is a view
    that keeps the buffer alive. One holder at a time, so that each original is freed as its
    copy is made (when nothing else holds it): the memory in use grows by one weight, not by
    all of them. Leaves the weights where they are when huge pages are off (`enabled`)."""
    weights = [holder.weight for holder in holders]
    if not enabled() or not weights or any(w.device.type != "cpu" for w in weights):
        return
    offsets, size = [], 0
    for weight in weights:
        offsets.append(size)
        size = _aligned(size + weight.numel() * weight.element_size(), ALIGN)
    del weights
    buffer = empty_on_huge_pages(size)
    for holder, offset in zip(holders, offsets):
        weight = holder.weight
        num_bytes = weight.numel() * weight.element_size()
        view = buffer[offset:offset + num_bytes].view(weight.dtype).view(weight.shape)
        view.copy_(weight)
        holder.weight = view
