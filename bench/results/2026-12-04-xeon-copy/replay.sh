#!/usr/bin/env bash
# Tokens per step by replay (bench/draft_quality.py) of the drafter without and with its copy
# source, from the repository root after scripts/setup.sh; see NOTES.md. The greedy answers are
# generated once by the engine and cached under var/bench/references/.
set -euo pipefail
R=bench/results/2026-12-04-xeon-copy
DQ=".venv/bin/python -m bench.draft_quality"
{
  # Held out for choosing the copy source's constants: the code-edit files after the benchmark's
  # and ShareGPT records 12,000-14,999.
  $DQ --sets code-edits-tune,sharegpt-tune --prompts 40 --max-tokens 256 --budgets 16,32 \
    --config paper:copy_min_match=0 --config m8:copy_min_match=8 --config m4:copy_min_match=4 \
    --config m6:copy_min_match=6 --config m12:copy_min_match=12 \
    --config d1:copy_min_match=8,copy_discount=1.0,copy_child_discount=1.0 \
    --config d8:copy_min_match=8,copy_discount=0.8,copy_child_discount=0.9 \
    --config len64:copy_min_match=8,copy_len=64
} > $R/replay-tune.jsonl 2> $R/replay-tune.err
{
  # Then, with the constants chosen (the defaults), the benchmark's sets.
  $DQ --sets code-edits --prompts 8 --max-tokens 256 --budgets 8,16,32 \
    --config paper:copy_min_match=0 --config copy:
  $DQ --sets mt_bench,code --prompts 80 --max-tokens 128 --budgets 8,16,32 \
    --config paper:copy_min_match=0 --config copy:
} > $R/replay.jsonl 2> $R/replay.err
# Steps that accept nothing, at budgets 16 and 32, input trie alone and with the datastore.
for budget in 16 32; do
  .venv/bin/python $R/zero_accept.py --budget $budget
done > $R/zero-accept.jsonl 2> $R/zero-accept.err
