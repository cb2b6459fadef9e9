"""The tree attention alone (sssd._kernels.attention, one layer of a verification step) on each
path this CPU can run, taking turns in one process: the AVX-512 loop, its bfloat16 scores on
AVX-512 BF16's dot products (dpbf16) or on the AMX tile unit (amx), and the AVX2 loop.

    .venv/bin/python bench/tree_attention.py [--model qwen-coder-1.5b] \\
        [--cells 1x1,1x8,1x16,4x1,4x2,8x1] [--contexts 300,800] [--rounds 5] \\
        [--block-sizes 16,0]

A cell is b sequences x n nodes (a chain), each sequence with `context` keys cached before
its nodes; random bfloat16 queries, keys and values of the model's head shape, in a paged cache
of blocks of --block-sizes positions (0: one block per sequence, its keys contiguous), the
blocks of each sequence shuffled over the cache. One JSON line per (cell, context, block size,
path): the median microseconds of a call over the rounds (each round the mean of --calls
calls), and what a step of the model's layers spends on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from sssd import _kernels
from sssd.common.model import kernel_paths

# query heads, key/value heads, head size, layers
HEADS = {
    "qwen-coder-1.5b": (12, 2, 128, 28),
    "qwen-coder-0.5b": (14, 2, 64, 24),
    "smollm2": (9, 3, 64, 30),
}
BFLOAT16 = 1  # sssd._kernels' dtype code


# Each path as kernel_paths forces it.
PATHS = {"amx": dict(tree_attention="avx512", attention_scores="amx"),
         "dpbf16": dict(tree_attention="avx512", attention_scores="dpbf16"),
         "avx512": dict(tree_attention="avx512", attention_scores="avx512"),
         "avx2": dict(tree_attention="avx2")}


def runnable_paths() -> list[str]:
    features = kernel_paths.cpu_features()
    can = {"amx": features["amx_bf16"], "dpbf16": features["avx512_bf16"],
           "avx512": features["avx512"], "avx2": features["avx2_fma"]}
    return [path for path in PATHS if can[path]]


def make_call(heads: int, kv_heads: int, head_dim: int, num_seqs: int, num_nodes: int,
              context: int, block_size: int, generator: torch.Generator):
    length = context + num_nodes
    block = block_size or -(-length // 16) * 16
    per_row = -(-length // block)
    num_blocks = num_seqs * per_row
    keys = torch.randn(num_blocks, kv_heads, block, head_dim, generator=generator)
    values = torch.randn(num_blocks, kv_heads, block, head_dim, generator=generator)
    q = torch.randn(num_seqs, num_nodes, heads, head_dim, generator=generator)
    keys, values, q = (t.to(torch.bfloat16) for t in (keys, values, q))
    tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, per_row) \
        .to(torch.int32).contiguous()
    out = torch.empty(num_seqs, num_nodes, heads * head_dim, dtype=torch.bfloat16)
    lens = torch.full((num_seqs,), context, dtype=torch.int64)
    chain = [(1 << (j + 1)) - 1 for j in range(num_nodes)]  # node j sees nodes 0..j
    bits = torch.from_numpy(np.array([chain] * num_seqs, dtype=np.uint64).view(np.int64))
    positions = torch.zeros(num_seqs * num_nodes, dtype=torch.int64)
    layout = _kernels.KvLayout([keys.data_ptr()], [values.data_ptr()], num_blocks, block,
                               kv_heads, head_dim, BFLOAT16)
    rows = _kernels.StepRows(layout, num_seqs, num_nodes, lens.data_ptr(), tables.data_ptr(),
                             per_row, bits.data_ptr(), positions.data_ptr())
    held = (keys, values, q, tables, out, lens, bits, positions)

    def call() -> None:
        assert held
        _kernels.attention(layout, 0, rows, q.data_ptr(), out.data_ptr(), heads,
                           head_dim ** -0.5)
    return call


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen-coder-1.5b", choices=sorted(HEADS))
    parser.add_argument("--cells", default="1x1,1x8,1x16,4x1,4x2,8x1",
                        help="sequences x nodes, comma-separated")
    parser.add_argument("--contexts", default="300,800", help="cached keys per sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    parser.add_argument("--block-sizes", default="16,0",
                        help="positions per cache block, comma-separated (0: one block per "
                        "sequence)")
    args = parser.parse_args(argv)
    heads, kv_heads, head_dim, layers = HEADS[args.model]
    paths = runnable_paths()
    if not paths:
        raise SystemExit("this CPU runs only the portable attention (no AVX2 or AVX-512)")
    cells = [tuple(int(n) for n in cell.split("x")) for cell in args.cells.split(",")]
    generator = torch.Generator().manual_seed(0)
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    for context in (int(c) for c in args.contexts.split(",")):
        for num_seqs, num_nodes in cells:
            for block_size in block_sizes:
                call = make_call(heads, kv_heads, head_dim, num_seqs, num_nodes, context,
                                 block_size, generator)
                seconds: dict[str, list[float]] = {path: [] for path in paths}
                for _ in range(args.rounds):
                    for path in paths:  # the paths take turns within each round
                        with kernel_paths.forced(**PATHS[path]):
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
                        "nodes": num_nodes, "context": context, "block_size": block_size,
                        "us_per_call": round(1e6 * median, 1),
                        "ms_per_step": round(1e3 * median * layers, 2),
                        "rounds": args.rounds}), flush=True)

if __name__ == "__main__":
    main()
