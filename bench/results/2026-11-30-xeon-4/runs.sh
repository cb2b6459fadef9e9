#!/usr/bin/env bash
# MT-Bench at the answer lengths chat is served at: b = 1 with 512-token answers, b = 4 with
# 256-token answers (earlier runs: 128 / 256 at b = 1, 64 at b = 4).
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-4
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
P=var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json
E=".venv/bin/python bench/e2e.py --model qwen-coder-1.5b --datastore $DS --drafter inproc --profile $P"
log() { echo "$(date +%T) $*" >> $R/runs.log; }
log start chat-b1-512
$E --set mt_bench --prompts 8 --max-tokens 512 --batch-sizes 1 --modes ar,sssd \
  --policies measured,fixed:16 --chunks 8 --hf-prompts 0 --png $R/e2e-qwen-chat-b1-512.png \
  > $R/e2e-qwen-chat-b1-512.jsonl 2> $R/e2e-qwen-chat-b1-512.err
log start chat-b4-256
$E --set mt_bench --prompts 16 --max-tokens 256 --batch-sizes 4 --modes ar,sssd \
  --policies measured,fixed:4,fixed:8 --chunks 4 --hf-prompts 0 \
  --png $R/e2e-qwen-chat-b4-256.png > $R/e2e-qwen-chat-b4-256.jsonl 2> $R/e2e-qwen-chat-b4-256.err
log done
# The b = 4 run above drains (2.4 rows a step): chunks of 12 prompts at batch 4 keep it fuller.
log start chat-b4-256-full
$E --set mt_bench --prompts 24 --max-tokens 256 --batch-sizes 4 --modes ar,sssd \
  --policies measured,fixed:4,fixed:8 --chunks 2 --hf-prompts 0 \
  --png $R/e2e-qwen-chat-b4-256-full.png > $R/e2e-qwen-chat-b4-256-full.jsonl \
  2> $R/e2e-qwen-chat-b4-256-full.err
log done
# The b = 1 cell again: the measured policy was at 0.946 of fixed 16 in the first run.
log start chat-b1-512-again
$E --set mt_bench --prompts 8 --max-tokens 512 --batch-sizes 1 --modes ar,sssd \
  --policies measured,fixed:16 --chunks 8 --hf-prompts 0 --png $R/e2e-qwen-chat-b1-512-again.png \
  > $R/e2e-qwen-chat-b1-512-again.jsonl 2> $R/e2e-qwen-chat-b1-512-again.err
log done
# After the policy change (budgets by increments, settled budgets re-timed): the same cell.
log start chat-b1-512-increments
$E --set mt_bench --prompts 8 --max-tokens 512 --batch-sizes 1 --modes ar,sssd \
  --policies measured,fixed:16 --chunks 8 --hf-prompts 0 --png $R/e2e-qwen-chat-b1-512-increments.png \
  > $R/e2e-qwen-chat-b1-512-increments.jsonl 2> $R/e2e-qwen-chat-b1-512-increments.err
log done
# SmolLM2 at b = 1 after the policy change (its non-regression), as in 2026-11-30-xeon-2.
log start smol
for s in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $s --prompts 8 --max-tokens 128 --batch-sizes 1 \
    --modes ar,sssd --policies measured,rule --chunks 8 --hf-prompts 0 \
    --datastore var/demo-datastore/sharegpt-12000-ba75b552aebd \
    --profile var/profiles/smol-e2e-forward-xeon.json --png $R/e2e-smol-$s-b1.png \
    > $R/e2e-smol-$s-b1.jsonl 2> $R/e2e-smol-$s-b1.err
done
log done
