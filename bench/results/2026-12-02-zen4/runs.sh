#!/usr/bin/env bash
# The runs of this folder, from the repository root in .venv (see NOTES.md).
set -euo pipefail
R=bench/results/2026-12-02-zen4
DS=var/demo-datastore/sharegpt-12000-ba75b552aebd  # what `sssd up` builds for SmolLM2
# Before and after the house changes: tokens per step must not move.
tag=${TAG:-after}
.venv/bin/python bench/draft_quality.py --datastore $DS > $R/draft-quality-$tag.jsonl 2> $R/draft-quality-$tag.err
.venv/bin/python bench/e2e.py --prompts 16 --batch-sizes 1,8 --datastore $DS --hf-prompts 0 \
  --policies rule,measured,fixed:8 --png var/bench/e2e-$tag.png \
  > $R/e2e-smol-mt_bench-$tag.jsonl 2> $R/e2e-smol-mt_bench-$tag.err
