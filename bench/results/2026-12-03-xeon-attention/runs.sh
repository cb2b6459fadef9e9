#!/usr/bin/env bash
# The attention's key segments (see NOTES.md), from the repository root after scripts/setup.sh:
# this commit's kernels against those of 6ecfab9 (the commit before them, built from a temporary
# worktree), taking turns: a long context's prefill and decode step in the whole model (three
# rounds), then the attention kernel alone on each of this CPU's paths (two rounds).
set -euo pipefail
R=bench/results/2026-12-03-xeon-attention
BASE=$(mktemp -d)/base
git worktree add -q "$BASE" 6ecfab9
trap 'git worktree remove --force "$BASE"' EXIT
cmake -S "$BASE" -B "$BASE/build" -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$PWD/.venv/bin/python" > "$BASE.build.log" 2>&1
cmake --build "$BASE/build" --target _kernels --parallel "$(nproc)" >> "$BASE.build.log" 2>&1
OLD=$(ls "$BASE"/build/_kernels.*.so)
for round in 1 2 3; do
  .venv/bin/python $R/decode_ab.py --kernels "$OLD" --label 6ecfab9
  .venv/bin/python $R/decode_ab.py
done > $R/decode-ab.jsonl 2> $R/decode-ab.err
for round in 1 2; do
  for path in amx dpbf16 avx2; do
    .venv/bin/python $R/kernel_ab.py --kernels "$OLD" --label 6ecfab9 --path $path
    .venv/bin/python $R/kernel_ab.py --path $path
  done
done > $R/kernel-ab.jsonl
