# Qwen2.5-Coder-1.5B-Instruct (bfloat16, the ShareGPT datastore of 12,000 records built with its
# tokenizer) on the 2-core AMD EPYC Zen 4 (AVX-512 BF16, no AMX) after the tree attention took
# its scores on AVX-512 BF16's dot products. The forward profile is measured by the first run
# (b = 1, 2, 4) into var/profiles/qwen-coder-1.5b/dpbf16-b4.json: a profile of the earlier
# kernels is refused (its setting names the kernels' build).
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/2026-12-01-zen4-attention
Q="--model qwen-coder-1.5b --datastore var/demo-datastore/sharegpt-12000-3f34145de91b"
P=var/profiles/qwen-coder-1.5b/dpbf16-b4.json
mkdir -p var/profiles/qwen-coder-1.5b
# 1. The attention alone, each path taking turns.
.venv/bin/python bench/tree_attention.py > $R/tree-attention-qwen.jsonl
E=".venv/bin/python bench/e2e.py $Q --drafter inproc --hf-prompts 0"
# 2. b = 4, 16 prompts x 64 tokens (measures the profile).
for set in code mt_bench; do
  $E --set $set --prompts 16 --max-tokens 64 --batch-sizes 4 --modes ar,sssd \
    --policies measured,fixed:2,fixed:4 --chunks 4 --profile $P \
    --png $R/e2e-qwen-$set-b4.png 2> $R/e2e-qwen-$set-b4.err > $R/e2e-qwen-$set-b4.jsonl
done
# 3. b = 1, 8 prompts x 128 tokens.
for set in code mt_bench; do
  $E --set $set --prompts 8 --max-tokens 128 --batch-sizes 1 --modes ar,sssd \
    --policies measured,fixed:8,fixed:16 --chunks 4 --profile $P \
    --png $R/e2e-qwen-$set-b1.png 2> $R/e2e-qwen-$set-b1.err > $R/e2e-qwen-$set-b1.jsonl
done
# 4. SmolLM2-135M-Instruct (the default model) at b = 1, its profile measured by the first run.
S="--datastore var/demo-datastore/sharegpt-12000-ba75b552aebd --profile var/profiles/smol-dpbf16.json"
.venv/bin/python bench/tree_attention.py --model smollm2 --cells 1x1,1x8,1x16,8x1 --contexts 300 \
  > $R/tree-attention-smollm2.jsonl
for set in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $set --prompts 16 --max-tokens 128 --batch-sizes 1 \
    --modes ar,sssd --policies measured,rule,fixed:8,fixed:16 --chunks 4 --hf-prompts 0 \
    --drafter inproc $S --png $R/e2e-smol-$set-b1.png 2> $R/e2e-smol-$set-b1.err \
    > $R/e2e-smol-$set-b1.jsonl
done
# 5. Beside the peers at b = 1: our prompt lookup; transformers' generate, its prompt lookup and
#    its assisted generation with Qwen2.5-Coder-0.5B on the first 4 prompts (each over its own
#    generate); one prompt a turn.
for set in code mt_bench; do
  $E --set $set --prompts 8 --max-tokens 128 --batch-sizes 1 --modes ar,prompt_lookup,sssd \
    --policies measured,fixed:8 --chunks 8 --hf-prompts 4 --hf-assistant qwen-coder-0.5b \
    --profile $P --png $R/e2e-qwen-$set-b1-peers.png 2> $R/e2e-qwen-$set-b1-peers.err \
    > $R/e2e-qwen-$set-b1-peers.jsonl
done
# 6. Our ordinary speculative decoding and SSD with the 0.5B draft (the verifier and the
#    speculator a core each for sd and ssd_geometric), each over the AR run just before it.
.venv/bin/python bench/ssd.py --dtype bfloat16 --sets code,mt_bench --prompts 4 --max-tokens 48 \
  --configs ar,sd,ar,ssd_geometric,ar,sssd,ar \
  --datastore var/demo-datastore/sharegpt-12000-3f34145de91b --png $R/ssd-qwen-bf16-b1.png \
  > $R/ssd-qwen-bf16-b1.jsonl 2> $R/ssd-qwen-bf16-b1.err
# 7. SSSD in that program at budget 8 (its default, 16, costs 2.2-2.5x a plain step on this CPU).
.venv/bin/python bench/ssd.py --dtype bfloat16 --sets code,mt_bench --prompts 4 --max-tokens 48 \
  --configs ar,sssd,ar --sssd-budget 8 \
  --datastore var/demo-datastore/sharegpt-12000-3f34145de91b --png $R/ssd-qwen-bf16-b1-sssd8.png \
  > $R/ssd-qwen-bf16-b1-sssd8.jsonl 2> $R/ssd-qwen-bf16-b1-sssd8.err
