#!/usr/bin/env bash
# After runs-amx.sh: MT-Bench at b = 1 over 16 prompts (the kernel change moved bfloat16 answers,
# and 8 prompts' tokens per step swung from 2.65 to 2.16 with them), then SmolLM2-135M at b = 1
# (its non-regression; its head of 64 takes the same kernels).
set -u
cd /work/main
while pgrep -f "runs-amx[.]sh" > /dev/null; do sleep 10; done
R=bench/results/2026-11-30-xeon-5
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
P=var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json
E=".venv/bin/python bench/e2e.py --model qwen-coder-1.5b --datastore $DS --drafter inproc --profile $P"
log() { echo "$(date +%T) $*" >> $R/runs.log; }
log start mt_bench-b1-512-16-amx
$E --set mt_bench --prompts 16 --max-tokens 512 --batch-sizes 1 --modes ar,sssd \
  --policies measured,fixed:16 --chunks 16 --hf-prompts 0 --png $R/e2e-qwen-mt_bench-b1-512-16-amx.png \
  > $R/e2e-qwen-mt_bench-b1-512-16-amx.jsonl 2> $R/e2e-qwen-mt_bench-b1-512-16-amx.err
log start smol
for s in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $s --prompts 8 --max-tokens 128 --batch-sizes 1 \
    --modes ar,sssd --policies measured,rule --chunks 8 --hf-prompts 0 \
    --datastore var/demo-datastore/sharegpt-12000-ba75b552aebd \
    --profile var/profiles/smol-e2e-forward-xeon.json --png $R/e2e-smol-$s-b1-amx.png \
    > $R/e2e-smol-$s-b1-amx.jsonl 2> $R/e2e-smol-$s-b1-amx.err
done
log done
