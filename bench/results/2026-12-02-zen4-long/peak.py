"""The machine's arithmetic peak as PyTorch's bfloat16 matrix product reaches it (oneDNN, both
cores), and its streaming speed (a bfloat16 sum over 512 MiB): the floors NOTES.md prices the
prefill and the decode step against. Run from the repository root with .venv/bin/python."""
import json
import time

import torch

a = torch.randn(4096, 4096, dtype=torch.bfloat16)
b = torch.randn(4096, 4096, dtype=torch.bfloat16)
times = []
for _ in range(6):
    start = time.perf_counter()
    torch.matmul(a, b)
    times.append(time.perf_counter() - start)
flops = 2 * 4096 ** 3 / sorted(times)[len(times) // 2]
x = torch.ones(256 * 1024 * 1024, dtype=torch.bfloat16)
reads = []
for _ in range(5):
    start = time.perf_counter()
    x.sum()
    reads.append(time.perf_counter() - start)
print(json.dumps({"bf16_matmul_gflops": flops / 1e9, "threads": torch.get_num_threads(),
                  "stream_gb_s": x.numel() * 2 / sorted(reads)[len(reads) // 2] / 1e9}))
