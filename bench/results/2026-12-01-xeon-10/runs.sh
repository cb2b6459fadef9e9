# Qwen2.5-Coder-1.5B-Instruct (bfloat16, the ShareGPT datastore of 12,000 records built with its
# tokenizer) on a 2-core Intel Xeon with AMX, the code as of the Zen 4 attention work (on this CPU
# the tree attention takes its scores on the AMX tile unit). Every configuration of a run takes
# its turn chunk by chunk.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/2026-12-01-xeon-10
Q="--model qwen-coder-1.5b --datastore var/demo-datastore/sharegpt-12000-3f34145de91b"
P=var/profiles/qwen-coder-1.5b/xeon-10.json
mkdir -p var/profiles/qwen-coder-1.5b
E=".venv/bin/python bench/e2e.py $Q --drafter inproc --hf-prompts 0 --profile $P"
# 1. The attention alone, each path taking turns.
.venv/bin/python bench/tree_attention.py > $R/tree-attention-qwen.jsonl
# 2. How far the drafter's sources reach: tokens per step by replay at budgets up to 256 nodes,
#    with the default samples and with four times as many.
.venv/bin/python bench/draft_quality.py --model qwen-coder-1.5b --sets code,mt_bench \
  --prompts 24 --budgets 8,16,32,64,256 --datastore var/demo-datastore/sharegpt-12000-3f34145de91b \
  --config default: --config samples400:max_continuations=400,min_continuations=200 \
  > $R/draft-quality-ceiling.jsonl 2> $R/draft-quality-ceiling.err
# 3. b = 1, 8 prompts x 128 tokens (the first measures the profile at b = 1; the first b = 4
#    run below measures it again for b = 1, 2 and 4).
for set in code mt_bench; do
  $E --set $set --prompts 8 --max-tokens 128 --batch-sizes 1 --modes ar,sssd \
    --policies measured,fixed:8,fixed:16 --chunks 4 \
    --png $R/e2e-qwen-$set-b1.png 2> $R/e2e-qwen-$set-b1.err > $R/e2e-qwen-$set-b1.jsonl
done
# 4. MT-Bench at the lengths its answers end at (up to 512 tokens), one prompt a turn.
$E --set mt_bench --prompts 8 --max-tokens 512 --batch-sizes 1 --modes ar,sssd \
  --policies measured,fixed:16 --chunks 8 \
  --png $R/e2e-qwen-mt_bench-b1-512.png 2> $R/e2e-qwen-mt_bench-b1-512.err \
  > $R/e2e-qwen-mt_bench-b1-512.jsonl
# 5. b = 4, 16 prompts x 64 tokens.
for set in code mt_bench; do
  $E --set $set --prompts 16 --max-tokens 64 --batch-sizes 4 --modes ar,sssd \
    --policies measured,fixed:2,fixed:4 --chunks 4 \
    --png $R/e2e-qwen-$set-b4.png 2> $R/e2e-qwen-$set-b4.err > $R/e2e-qwen-$set-b4.jsonl
done
# 6. SmolLM2-135M-Instruct (the default model) at b = 1, its profile measured by the first run.
S="--datastore var/demo-datastore/sharegpt-12000-ba75b552aebd --profile var/profiles/smol-xeon-10.json"
for set in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $set --prompts 16 --max-tokens 128 --batch-sizes 1 \
    --modes ar,sssd --policies measured,rule,fixed:8,fixed:16 --chunks 4 --hf-prompts 0 \
    --drafter inproc $S --png $R/e2e-smol-$set-b1.png 2> $R/e2e-smol-$set-b1.err \
    > $R/e2e-smol-$set-b1.jsonl
done
