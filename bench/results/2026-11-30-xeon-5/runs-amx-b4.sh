#!/usr/bin/env bash
# b = 4 on MT-Bench after both kernel changes (24 x 256 tokens, chunks of 12: a full batch), as
# in 2026-11-30-xeon-4's chat-b4-256-full before them.
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-5
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
P=var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json
E=".venv/bin/python bench/e2e.py --model qwen-coder-1.5b --datastore $DS --drafter inproc --profile $P"
log() { echo "$(date +%T) $*" >> $R/runs.log; }
log start chat-b4-256-amx
$E --set mt_bench --prompts 24 --max-tokens 256 --batch-sizes 4 --modes ar,sssd \
  --policies measured,fixed:4,fixed:8 --chunks 2 --hf-prompts 0 \
  --png $R/e2e-qwen-chat-b4-256-amx.png > $R/e2e-qwen-chat-b4-256-amx.jsonl \
  2> $R/e2e-qwen-chat-b4-256-amx.err
log done
