#!/usr/bin/env bash
# b = 1 at the answer lengths code and chat are served at (512 tokens), after the budget policy's
# increments (83eae90) and the row kernels split between threads (bbe585b): code had not run at
# 512 tokens since the policy change; chat is the cell whose median prompt was 4 % short of 2x.
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-5
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
P=var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json
E=".venv/bin/python bench/e2e.py --model qwen-coder-1.5b --datastore $DS --drafter inproc --profile $P"
log() { echo "$(date +%T) $*" >> $R/runs.log; }
for s in code mt_bench; do
  log start $s-b1-512
  $E --set $s --prompts 8 --max-tokens 512 --batch-sizes 1 --modes ar,sssd \
    --policies measured,fixed:16 --chunks 8 --hf-prompts 0 --png $R/e2e-qwen-$s-b1-512.png \
    > $R/e2e-qwen-$s-b1-512.jsonl 2> $R/e2e-qwen-$s-b1-512.err
done
log done
