#!/usr/bin/env bash
# Sequential measurement runs of this stop; each waits for the one before.
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-2
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
P=var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json
E=".venv/bin/python bench/e2e.py --model qwen-coder-1.5b --datastore $DS --drafter inproc --profile $P"
log() { echo "$(date +%T) $*" >> $R/runs.log; }
log start chat256
$E --set mt_bench --prompts 8 --max-tokens 256 --batch-sizes 1 --modes ar,sssd \
  --policies measured,fixed:8,fixed:16 --chunks 8 --hf-prompts 0 --png $R/e2e-qwen-chat-b1-256.png \
  > $R/e2e-qwen-chat-b1-256.jsonl 2> $R/e2e-qwen-chat-b1-256.err
log start chat128-hf
$E --set mt_bench --prompts 8 --max-tokens 128 --batch-sizes 1 --modes ar,prompt_lookup,sssd \
  --policies measured,fixed:16 --chunks 8 --hf-prompts 4 --hf-assistant qwen-coder-0.5b \
  --png $R/e2e-qwen-chat-b1-hf.png > $R/e2e-qwen-chat-b1-hf.jsonl 2> $R/e2e-qwen-chat-b1-hf.err
log start chat-b4-b8
$E --set mt_bench --prompts 16 --max-tokens 64 --batch-sizes 4,8 --modes ar,sssd \
  --policies measured,fixed:2,fixed:4,fixed:8 --chunks 4 --hf-prompts 0 \
  --png $R/e2e-qwen-chat-b4-b8.png > $R/e2e-qwen-chat-b4-b8.jsonl 2> $R/e2e-qwen-chat-b4-b8.err
log start code-b4-b8
$E --set code --prompts 16 --max-tokens 64 --batch-sizes 4,8 --modes ar,sssd \
  --policies measured,fixed:2,fixed:4,fixed:8 --chunks 4 --hf-prompts 0 \
  --png $R/e2e-qwen-code-b4-b8.png > $R/e2e-qwen-code-b4-b8.jsonl 2> $R/e2e-qwen-code-b4-b8.err
log start code256
$E --set code --prompts 8 --max-tokens 256 --batch-sizes 1 --modes ar,sssd \
  --policies measured,fixed:16 --chunks 8 --hf-prompts 0 --png $R/e2e-qwen-code-b1-256.png \
  > $R/e2e-qwen-code-b1-256.jsonl 2> $R/e2e-qwen-code-b1-256.err
log start ssd
.venv/bin/python bench/ssd.py --dtype bfloat16 --sets code,mt_bench --prompts 4 --max-tokens 48 \
  --configs ar,sd,ar,ssd_geometric,ar,sssd,ar --datastore $DS --png $R/ssd-qwen-bf16-b1.png \
  > $R/ssd-qwen-bf16-b1.jsonl 2> $R/ssd-qwen-bf16-b1.err
log start smol
for s in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $s --prompts 8 --max-tokens 128 --batch-sizes 1 \
    --modes ar,sssd --policies measured,rule --chunks 8 --hf-prompts 0 \
    --datastore var/demo-datastore/sharegpt-12000-ba75b552aebd \
    --profile var/profiles/smol-e2e-forward-xeon.json --png $R/e2e-smol-$s-b1.png \
    > $R/e2e-smol-$s-b1.jsonl 2> $R/e2e-smol-$s-b1.err
done
log start vllm
.venv-vllm/bin/python bench/vllm_peers.py --model qwen-coder-1.5b --dtype bfloat16 \
  --sets code,mt_bench --prompts 6 --max-tokens 48 --batch-sizes 1 \
  --modes none,ngram,suffix,sssd,engine --datastore $DS \
  --out $R/vllm-peers-qwen-bf16-b1.jsonl > $R/vllm-peers.out 2> $R/vllm-peers.err
log done
