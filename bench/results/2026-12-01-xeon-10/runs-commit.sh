# After the KV cache's commit became one sssd._kernels call (0fa92a0): SmolLM2-135M-Instruct at
# b = 1 again, the profile of runs.sh.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/2026-12-01-xeon-10
S="--datastore var/demo-datastore/sharegpt-12000-ba75b552aebd --profile var/profiles/smol-xeon-10.json"
for set in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $set --prompts 16 --max-tokens 128 --batch-sizes 1 \
    --modes ar,sssd --policies measured,fixed:16 --chunks 4 --hf-prompts 0 \
    --drafter inproc $S --png $R/e2e-smol-$set-b1-commit.png 2> $R/e2e-smol-$set-b1-commit.err \
    > $R/e2e-smol-$set-b1-commit.jsonl
done
