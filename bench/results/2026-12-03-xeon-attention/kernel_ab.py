"""sssd._kernels.attention alone on two builds of the module, side by side: one call of one layer
for each cell (sequences x nodes at a context, SmolLM2's or Qwen2.5-Coder's head shapes, blocks
of 16 positions shuffled over the cache), through a ring of --ring such layers so that their keys
and values come from memory, not the cache, as a whole model's 24-30 layers do. Prints one JSON
line per cell: the median microseconds a layer over 5 rounds of 10 passes of the ring.

    .venv/bin/python bench/results/2026-12-03-xeon-attention/kernel_ab.py \\
        [--kernels PATH/_kernels.cpython-311-x86_64-linux-gnu.so] [--label baseline] \\
        [--path amx] [--ring 8]
"""
import argparse
import json
import statistics
import subprocess
import time

from old_kernels import use_kernels  # beside this script

parser = argparse.ArgumentParser()
parser.add_argument("--kernels", help="another build of sssd._kernels to load")
parser.add_argument("--label", default=subprocess.run(
    ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    help="what the lines call this build (default: the checkout's commit)")
parser.add_argument("--path", default="amx", help="amx, dpbf16, avx512 or avx2")
parser.add_argument("--ring", type=int, default=8)
args = parser.parse_args()
if args.kernels:
    use_kernels(args.kernels)

import torch  # noqa: E402

from bench import tree_attention  # noqa: E402
from sssd import _kernels  # noqa: E402

# (model, sequences, nodes, context): decode at b = 1 and 4, a draft tree, prefill rows of 64.
CELLS = [("smollm2", 1, 1, 300), ("smollm2", 1, 1, 2000), ("smollm2", 1, 1, 8000),
         ("smollm2", 4, 1, 4000), ("qwen-coder-1.5b", 1, 1, 8000), ("smollm2", 1, 16, 8000),
         ("smollm2", 8, 64, 2000), ("smollm2", 4, 64, 8000)]
generator = torch.Generator().manual_seed(0)
for kernel, path in tree_attention.PATHS[args.path].items():
    _kernels.force_path(kernel, path)
for model, num_seqs, num_nodes, context in CELLS:
    heads, kv_heads, head_dim, _ = tree_attention.HEADS[model]
    ring = [tree_attention.make_call(heads, kv_heads, head_dim, num_seqs, num_nodes, context, 16,
                                     generator) for _ in range(args.ring)]
    for call in ring:
        call()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            for call in ring:
                call()
        rounds.append((time.perf_counter() - start) / (10 * len(ring)))
    print(json.dumps({"kernels": args.label, "path": args.path, "model": model,
                      "batch": num_seqs, "nodes": num_nodes, "context": context,
                      "us_per_layer": round(1e6 * statistics.median(rounds), 1)}), flush=True)
    del ring
