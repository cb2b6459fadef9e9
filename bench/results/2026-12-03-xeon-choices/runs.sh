#!/usr/bin/env bash
# n = 4 choices of one code-edit prompt, prefilled once (this commit's scheduler) against side
# by side (the wait turned off), from the repository root after scripts/setup.sh: prompts of
# 300-500 tokens (all four fit one step's 512-token prefill budget) and of 1,800-2,600 tokens
# (several chunks). See NOTES.md.
set -euo pipefail
R=bench/results/2026-12-03-xeon-choices
{
  .venv/bin/python $R/choices_ab.py --n 4 --max-tokens 64 --rounds 3 --low 300 --high 500
  .venv/bin/python $R/choices_ab.py --n 4 --max-tokens 64 --rounds 3 --low 1800 --high 2600
} > $R/choices-ab.jsonl 2> $R/choices-ab.err
