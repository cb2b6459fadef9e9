# The measured policy's row_decay, 0.1 against 0.05, in the engine with priced steps
# (bench/policy_engine.py), SmolLM2-135M bfloat16, ShareGPT datastore, 16 prompts x 128 tokens.
# Costs: full-step milliseconds at each fixed budget from bench/e2e.py runs on this machine just
# before (b = 1: code fixed 4/8/16 and AR, `--prompts 8 --chunks 4`; b = 4: code fixed 2/4/8/16,
# `--prompts 16`; their output was read, not kept); budget 2 at b = 1 and 32 at b = 4 were not
# measured and are guesses.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/2026-11-30-xeon-7
P="--profile var/profiles/smol-e2e-forward-xeon.json --datastore var/demo-datastore/sharegpt-12000-ba75b552aebd"
.venv/bin/python bench/policy_engine.py --sets code,mt_bench --prompts 16 --batch-size 4 \
  --costs 1:19.9,2:22.9,4:25.2,8:31.3,16:43.7,32:70 --drain-rows 3 \
  --drain-costs 1:18.3,2:20.6,4:21.1,8:22.2,16:24.1,32:31.5 --fixed 4,8 --row-decays 0.1,0.05 \
  --orders 4 $P > $R/policy-engine-smol-b4-orders.jsonl 2> $R/policy-engine-smol-b4-orders.err
.venv/bin/python bench/policy_engine.py --sets code,mt_bench --prompts 16 --batch-size 1 \
  --costs 1:18.3,2:20.6,4:21.1,8:22.2,16:24.1,32:31.5 --fixed 8,16 --row-decays 0.1,0.05 \
  --orders 3 $P > $R/policy-engine-smol-b1-orders.jsonl 2> $R/policy-engine-smol-b1-orders.err
# Then, with row_decay 0.05 the default, end to end on the machine (real step times):
for set in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $set --prompts 16 --max-tokens 128 --batch-sizes 1 --modes ar,sssd \
    --policies measured,fixed:16 --chunks 4 --hf-prompts 0 --drafter inproc $P \
    --png $R/e2e-smol-$set-b1.png 2> $R/e2e-smol-$set-b1.err > $R/e2e-smol-$set-b1.jsonl
done
# Qwen2.5-Coder-1.5B prefill after the prompt attention's scores moved to the AMX tile unit:
.venv/bin/python bench/prefill.py --models qwen-coder-1.5b --lengths 512,2000 --systems engine,vllm \
  --rounds 2 --repeats 2 --out $R/prefill-qwen.jsonl
