#!/usr/bin/env bash
# Code at b = 4 and both sets at b = 8 after the row kernels and the AMX scores (bbe585b,
# a64f14f), the cells that 2026-11-30-xeon-5 did not re-run.
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-6
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
P=var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json
E=".venv/bin/python bench/e2e.py --model qwen-coder-1.5b --datastore $DS --drafter inproc --profile $P"
log() { echo "$(date +%T) $*" >> $R/runs.log; }
log start code-b4-256
$E --set code --prompts 24 --max-tokens 256 --batch-sizes 4 --modes ar,sssd \
  --policies measured,fixed:4,fixed:8 --chunks 2 --hf-prompts 0 \
  --png $R/e2e-qwen-code-b4-256.png > $R/e2e-qwen-code-b4-256.jsonl 2> $R/e2e-qwen-code-b4-256.err
for set in code mt_bench; do
  log start $set-b8-256
  $E --set $set --prompts 32 --max-tokens 256 --batch-sizes 8 --modes ar,sssd \
    --policies measured,fixed:2,fixed:4 --chunks 2 --hf-prompts 0 \
    --png $R/e2e-qwen-$set-b8-256.png > $R/e2e-qwen-$set-b8-256.jsonl 2> $R/e2e-qwen-$set-b8-256.err
done
log done
