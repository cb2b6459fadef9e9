#!/usr/bin/env bash
# The engine on the whole-file code edits, each drafter without and with its copy source, taking
# turns in one process (copy_ab.py), from the repository root after scripts/setup.sh (the
# ShareGPT datastore is the one `sssd up` builds, var/demo-datastore/). See NOTES.md; replay.sh
# holds the replays.
set -euo pipefail
R=bench/results/2026-12-04-xeon-copy
.venv/bin/python $R/copy_ab.py --files 8 --max-tokens 256 \
  > $R/copy-ab.jsonl 2> $R/copy-ab.err
# The same with the rule policy (16 nodes a step at b = 1): tokens per step without the measured
# policy's online choice of budgets.
.venv/bin/python $R/copy_ab.py --files 8 --max-tokens 256 --budget-policy rule \
  > $R/copy-ab-rule.jsonl 2> $R/copy-ab-rule.err
# Qwen2.5-Coder-1.5B (`sssd-models fetch qwen-coder-1.5b`), 4 files, the measured policy, the
# datastore `sssd up` builds for its tokenizer.
.venv/bin/python $R/copy_ab.py --model qwen-coder-1.5b --files 4 --max-tokens 256 \
  > $R/copy-ab-qwen.jsonl 2> $R/copy-ab-qwen.err
