#!/usr/bin/env bash
# The measured policy with the tie tolerance at 0.01 (was 0.03), against the fixed budgets.
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-3
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
P=var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json
E=".venv/bin/python bench/e2e.py --model qwen-coder-1.5b --datastore $DS --drafter inproc --profile $P"
log() { echo "$(date +%T) $*" >> $R/runs.log; }
log start chat128
$E --set mt_bench --prompts 8 --max-tokens 128 --batch-sizes 1 --modes ar,sssd \
  --policies measured,fixed:8,fixed:16 --chunks 8 --hf-prompts 0 --png $R/e2e-qwen-chat-b1.png \
  > $R/e2e-qwen-chat-b1.jsonl 2> $R/e2e-qwen-chat-b1.err
log start code-b4-b8
$E --set code --prompts 16 --max-tokens 64 --batch-sizes 4,8 --modes ar,sssd \
  --policies measured,fixed:2,fixed:4 --chunks 4 --hf-prompts 0 \
  --png $R/e2e-qwen-code-b4-b8.png > $R/e2e-qwen-code-b4-b8.jsonl 2> $R/e2e-qwen-code-b4-b8.err
log done
