#!/usr/bin/env bash
# The same b = 1 cells after the tree attention's scores moved to the AMX tile unit (the step of
# a tree of 16 nodes over 800 keys spent 22 ms in attention, 9.5 now by a kernel timing).
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-5
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
P=var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json
E=".venv/bin/python bench/e2e.py --model qwen-coder-1.5b --datastore $DS --drafter inproc --profile $P"
log() { echo "$(date +%T) $*" >> $R/runs.log; }
for s in mt_bench code; do
  log start $s-b1-512-amx
  $E --set $s --prompts 8 --max-tokens 512 --batch-sizes 1 --modes ar,sssd \
    --policies measured,fixed:16 --chunks 8 --hf-prompts 0 --png $R/e2e-qwen-$s-b1-512-amx.png \
    > $R/e2e-qwen-$s-b1-512-amx.jsonl 2> $R/e2e-qwen-$s-b1-512-amx.err
done
log done
