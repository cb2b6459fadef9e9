"""All of a decode step's matrix products, timed alone: the verifier's panels
(sssd._kernels.linear_bf16 / linear_f32, and in bfloat16 on CPUs with AMX the same panels on the
tile unit, linear_bf16_amx) against oneDNN's prepacked products, beside a plain read of as many
bytes, in one process, taking turns.

    .venv/bin/python bench/linear_panels.py [--model qwen-coder-1.5b] [--dtype bfloat16]
        [--rows 1,2,4,8,16] [--rounds 5] [--out bench/results/linear-panels.jsonl]

Random weights of the model's shapes (every layer's fused QKV, output, fused gate/up and down
projections, then the output head); no model file is read. Each round runs every row count
with every implementation, then the read (sssd._kernels.read_bytes over a buffer of the
weights' size, read once as the products read theirs). One JSON line per (implementation,
rows): the median milliseconds over the rounds and the bytes per second they mean.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import flags
from sssd import _kernels

# hidden, intermediate, query heads, key/value heads, head size, layers, vocabulary
SHAPES = {
    "qwen-coder-1.5b": (1536, 8960, 12, 2, 128, 28, 151936),
    "qwen-coder-0.5b": (896, 4864, 14, 2, 64, 24, 151936),
    "smollm2": (576, 1536, 9, 3, 64, 30, 49152),
}


def products(model: str) -> list[tuple[int, int]]:
    """(out_features, in_features) of every product of a step, in order."""
    hidden, inter, heads, kv_heads, head_dim, layers, vocab = SHAPES[model]
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim),
             (2 * inter, hidden), (hidden, inter)]
    return layer * layers + [(vocab, hidden)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen-coder-1.5b", choices=sorted(SHAPES))
    flags.add_dtype(parser)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=5)
    flags.add_out(parser, None)
    args = parser.parse_args(argv)

    from sssd.common.model import kernel_paths
    from sssd.common.model.linear import Linear

    dtype = getattr(torch, args.dtype)
    cpu = torch.device("cpu")
    shapes = products(args.model)
    possible = kernel_paths.possible_products(dtype, cpu, [i for _, i in shapes])
    if "panels" not in possible:
        raise SystemExit(f"this CPU cannot run the {args.dtype} panels (AVX-512 or AVX2 and FMA "
                         "needed)")
    instructions = kernel_paths.path("panels", dtype)
    generator = torch.Generator().manual_seed(0)
    # The AMX products read the same packed panels: one copy of the weights serves both.
    # oneDNN beside them where it can prepack this dtype (not bfloat16 on an AVX2-only CPU)
    names = ("panels",) + tuple(name for name in ("onednn", "amx") if name in possible)
    layers = []
    for out_features, in_features in shapes:
        weight = (0.02 * torch.randn(out_features, in_features, generator=generator)).to(dtype)
        panels = Linear(weight, None, "panels")
        layers.append((panels,) + ((Linear(weight, None, "onednn"),) if "onednn" in names
                                   else ()))
        if "amx" in names:
            on_tiles = copy.copy(panels)
            on_tiles.layout = "amx"
            layers[-1] += (on_tiles,)
        del weight
    num_bytes = sum(o * i for o, i in shapes) * torch.finfo(dtype).bits // 8
    read_buffer = torch.ones(num_bytes // torch.finfo(dtype).bits * 8 // 64 * 64, dtype=dtype)
    read_bytes = read_buffer.numel() * read_buffer.element_size()
    print(f"{args.model} {args.dtype}: {len(shapes)} products, {num_bytes / 1e9:.2f} GB, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    times: dict[tuple[str, int], list[float]] = {}
    row_counts = [int(r) for r in args.rows.split(",")]
    for _ in range(args.rounds):
        for rows in row_counts:
            inputs = {i: torch.randn(rows, i, generator=generator).to(dtype)
                      for i in {i for _, i in shapes}}
            for index, name in enumerate(names):
                start = time.perf_counter()
                for pair, (_, in_features) in zip(layers, shapes):
                    pair[index](inputs[in_features])
                times.setdefault((name, rows), []).append(time.perf_counter() - start)
        start = time.perf_counter()
        _kernels.read_bytes(read_buffer.data_ptr(), read_bytes)
        times.setdefault(("read", 0), []).append(time.perf_counter() - start)
    lines = []
    for (name, rows), seconds in sorted(times.items()):
        median = statistics.median(seconds)
        lines.append(json.dumps({
            "model": args.model, "dtype": args.dtype, "impl": name, "rows": rows,
            "instructions": instructions if name == "panels" else None,
            "median_ms": round(1000 * median, 1), "gb_per_s": round(num_bytes / median / 1e9, 1),
            "rounds": len(seconds)}))
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
