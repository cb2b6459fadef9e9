"""The tree attention alone (sssd._kernels.attention, one layer of a verification step) on each
path this CPU can run, taking turns in one process: the AVX-512 loop, its bfloat16 scores on
AVX-512 BF16's dot products (dpbf16) or on the AMX tile unit (amx), and the AVX2 loop.

    .venv/bin/python bench/tree_attention.py [--model qwen-coder-1.5b] \\
        [--cells 1x1,1x8,1x16,4x1,4x2,8x1] [--contexts 300,800] [--rounds 5]

A cell is b sequences x n nodes (a chain), each sequence with `context` keys cached before
its nodes; random bfloat16 queries, keys and values of the model's head shape. One JSON line
per (cell, context, path): the median microseconds of a call over the rounds (each round the
mean of --calls calls), and what a step of the model's layers spends on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from sssd import _kernels

# query heads, key/value heads, head size, layers
HEADS = {
    "qwen-coder-1.5b": (12, 2, 128, 28),
    "qwen-coder-0.5b": (14, 2, 64, 24),
    "smollm2": (9, 3, 64, 30),
}
BFLOAT16 = 1  # sssd._kernels' dtype code


def set_path(path: str) -> None:
    """Runs the tree attention on `path` from the next call on."""
    _kernels.set_portable(False)
    _kernels.set_attention_avx2(path == "avx2")
    _kernels.set_attention_amx(path == "amx")
    _kernels.set_attention_dpbf16(path == "dpbf16")


def runnable_paths() -> list[str]:
    paths = []
    if _kernels.has_avx512():
        if _kernels.has_amx_bf16():
            paths.append("amx")
        if _kernels.has_avx512_bf16():
            paths.append("dpbf16")
        paths.append("avx512")
    if _kernels.has_avx2_fma():
        paths.append("avx2")
    return paths


def make_call(heads: int, kv_heads: int, head_dim: int, num_seqs: int, num_nodes: int,
              context: int, generator: torch.Generator):
    capacity = context + num_nodes
    keys = torch.randn(num_seqs, kv_heads, capacity, head_dim, generator=generator)
    values = torch.randn(num_seqs, kv_heads, capacity, head_dim, generator=generator)
    q = torch.randn(num_seqs, num_nodes, heads, head_dim, generator=generator)
    keys, values, q = (t.to(torch.bfloat16) for t in (keys, values, q))
    out = torch.empty(num_seqs, num_nodes, heads * head_dim, dtype=torch.bfloat16)
    lens = torch.full((num_seqs,), context, dtype=torch.int64)
    chain = [(1 << (j + 1)) - 1 for j in range(num_nodes)]  # node j sees nodes 0..j
    bits = torch.from_numpy(np.array([chain] * num_seqs, dtype=np.uint64).view(np.int64))

    def call() -> None:
        _kernels.attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), lens.data_ptr(),
                           bits.data_ptr(), out.data_ptr(), 0, num_seqs, num_nodes, heads,
                           kv_heads, head_dim, capacity, head_dim ** -0.5, BFLOAT16)
    return call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen-coder-1.5b", choices=sorted(HEADS))
    parser.add_argument("--cells", default="1x1,1x8,1x16,4x1,4x2,8x1",
                        help="sequences x nodes, comma-separated")
    parser.add_argument("--contexts", default="300,800", help="cached keys per sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    args = parser.parse_args(argv)
    heads, kv_heads, head_dim, layers = HEADS[args.model]
    paths = runnable_paths()
    if not paths:
        raise SystemExit("this CPU runs only the portable attention (no AVX2 or AVX-512)")
    cells = [tuple(int(n) for n in cell.split("x")) for cell in args.cells.split(",")]
    generator = torch.Generator().manual_seed(0)
    previous = (_kernels.set_portable(False), _kernels.set_attention_avx2(False),
                _kernels.set_attention_amx(True), _kernels.set_attention_dpbf16(True))
    try:
        for context in (int(c) for c in args.contexts.split(",")):
            for num_seqs, num_nodes in cells:
                call = make_call(heads, kv_heads, head_dim, num_seqs, num_nodes, context,
                                 generator)
                seconds: dict[str, list[float]] = {path: [] for path in paths}
                for _ in range(args.rounds):
                    for path in paths:  # the paths take turns within each round
                        set_path(path)
                        for _ in range(5):
                            call()
                        start = time.perf_counter()
                        for _ in range(args.calls):
                            call()
                        seconds[path].append((time.perf_counter() - start) / args.calls)
                for path in paths:
                    median = statistics.median(seconds[path])
                    print(json.dumps({
                        "model": args.model, "path": path, "batch": num_seqs,
                        "nodes": num_nodes, "context": context,
                        "us_per_call": round(1e6 * median, 1),
                        "ms_per_step": round(1e3 * median * layers, 2),
                        "rounds": args.rounds}), flush=True)
    finally:
        for setter, value in zip((_kernels.set_portable, _kernels.set_attention_avx2,
                                  _kernels.set_attention_amx, _kernels.set_attention_dpbf16),
                                 previous):
            setter(value)


if __name__ == "__main__":
    main()
