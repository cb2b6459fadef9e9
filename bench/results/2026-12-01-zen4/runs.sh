# The measured budget policy on Qwen2.5-Coder-1.5B-Instruct (bfloat16, the ShareGPT datastore of
# 12,000 records built with its tokenizer) in bench/policy_engine.py: the real engine, drafter and
# hindsight, each step priced from a cost table, on a 2-core AMD EPYC with AVX-512 BF16 (Zen 4;
# the products on the AVX-512 panels, no AMX). The cost tables are the forward profile measured
# at the start of this session on the quiet machine (quiet-b4.json, rows b = 1, 2, 4); the busy
# profile was measured beside a NumPy product on both cores (busy-b4.json) and served with its
# busy mark cleared (busy-b4-as-quiet.json), as if the start-up check had missed the load.
# Both were measured by the engine's own profile_forward through build_engine (a scratch
# script: EngineConfig(model="qwen-coder-1.5b", mode="prompt_lookup", budget_policy="measured",
# max_batch_size=4, profile_path=...)); `bench/e2e.py $Q --batch-sizes 4 --profile NEW.json`
# measures the same rows when NEW.json is missing.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/2026-12-01-zen4
Q="--model qwen-coder-1.5b --datastore var/demo-datastore/sharegpt-12000-3f34145de91b"
B1="--sets code,mt_bench --prompts 12 --batch-size 1"
QUIET="1:102.4,2:102.4,4:104.6,8:105.6,16:146.6,32:301.9"   # quiet-b4.json, b = 1
BUSY="1:414.5,2:414.5,4:414.5,8:414.5,16:521.4,32:1020"      # busy-b4.json, b = 1
mkdir -p var/profiles/qwen-coder-1.5b
cp $R/quiet-b4.json var/profiles/qwen-coder-1.5b/quiet-b4.json
cp $R/busy-b4-as-quiet.json var/profiles/qwen-coder-1.5b/busy-b4-as-quiet.json
# 1. Quiet profile, quiet machine; the real step times recorded for 5.
.venv/bin/python bench/policy_engine.py $Q $B1 --costs $QUIET --fixed 8,16 --orders 2 \
  --profile var/profiles/qwen-coder-1.5b/quiet-b4.json --record-steps $R/steps-qwen-b1.json \
  > $R/priced-qwen-b1-quiet.jsonl
# 2. Busy profile, quiet machine.
.venv/bin/python bench/policy_engine.py $Q $B1 --costs $QUIET --fixed 8 --orders 2 \
  --profile var/profiles/qwen-coder-1.5b/busy-b4-as-quiet.json > $R/priced-qwen-b1-busy-profile.jsonl
# 3. Quiet profile, busy machine (every step at the busy profile's price).
.venv/bin/python bench/policy_engine.py $Q $B1 --costs $BUSY --fixed 8 --orders 2 \
  --profile var/profiles/qwen-coder-1.5b/quiet-b4.json > $R/priced-qwen-b1-busy-machine.jsonl
# 4. b = 4 (steps of fewer than 3 rows, as a chunk drains, at the b = 2 row's price).
.venv/bin/python bench/policy_engine.py $Q --sets code,mt_bench --prompts 16 --max-tokens 64 \
  --batch-size 4 --costs 1:109.3,2:109.3,4:142.1,8:307.4,16:552.1,32:1119.2 --drain-rows 3 \
  --drain-costs 1:103.5,2:106.3,4:107.0,8:158.7,16:301.0,32:559.7 --fixed 2,4 --orders 3 \
  --profile var/profiles/qwen-coder-1.5b/quiet-b4.json > $R/priced-qwen-b4-quiet.jsonl
# 5. As 1 with the machine's own scatter: runs of 25 consecutive recorded steps of 1.
.venv/bin/python bench/policy_engine.py $Q $B1 --costs $QUIET --fixed 8 --orders 2 \
  --profile var/profiles/qwen-coder-1.5b/quiet-b4.json --step-noise $R/steps-qwen-b1.json \
  --noise-block 25 > $R/noise-qwen-b1-block25.jsonl
# 6. End to end on the machine (real step times; 8 prompts x 128 tokens at b = 1, 4 chunks taking
#    turns), with the quiet profile, then with the busy one served on the quiet machine.
E=".venv/bin/python bench/e2e.py $Q --drafter inproc --hf-prompts 0"
for set in code mt_bench; do
  $E --set $set --prompts 8 --max-tokens 128 --batch-sizes 1 --modes ar,sssd \
    --policies measured,fixed:8,fixed:16 --chunks 4 --profile var/profiles/qwen-coder-1.5b/quiet-b4.json \
    --png $R/e2e-qwen-$set-b1.png 2> $R/e2e-qwen-$set-b1.err > $R/e2e-qwen-$set-b1.jsonl
  $E --set $set --prompts 8 --max-tokens 128 --batch-sizes 1 --modes sssd \
    --policies measured,fixed:8 --chunks 4 --profile var/profiles/qwen-coder-1.5b/busy-b4-as-quiet.json \
    --png $R/e2e-qwen-$set-b1-busy-profile.png 2> $R/e2e-qwen-$set-b1-busy-profile.err \
    > $R/e2e-qwen-$set-b1-busy-profile.jsonl
done
# 7. b = 4, 16 prompts x 64 tokens.
for set in code mt_bench; do
  $E --set $set --prompts 16 --max-tokens 64 --batch-sizes 4 --modes ar,sssd \
    --policies measured,fixed:2,fixed:4 --chunks 4 --profile var/profiles/qwen-coder-1.5b/quiet-b4.json \
    --png $R/e2e-qwen-$set-b4.png 2> $R/e2e-qwen-$set-b4.err > $R/e2e-qwen-$set-b4.jsonl
done
# 8. The two b = 1 cells where the measured policy came out more than 5 % below fixed 8 (MT-Bench
#    with the quiet profile, code with the busy one), run again at once with the measured policy
#    taking its turn last in every chunk.
$E --set mt_bench --prompts 8 --max-tokens 128 --batch-sizes 1 --modes sssd \
  --policies fixed:8,measured --chunks 4 --profile var/profiles/qwen-coder-1.5b/quiet-b4.json \
  --png $R/e2e-qwen-mt_bench-b1-again.png 2> $R/e2e-qwen-mt_bench-b1-again.err \
  > $R/e2e-qwen-mt_bench-b1-again.jsonl
$E --set code --prompts 8 --max-tokens 128 --batch-sizes 1 --modes sssd \
  --policies fixed:8,measured --chunks 4 --profile var/profiles/qwen-coder-1.5b/busy-b4-as-quiet.json \
  --png $R/e2e-qwen-code-b1-busy-profile-again.png 2> $R/e2e-qwen-code-b1-busy-profile-again.err \
  > $R/e2e-qwen-code-b1-busy-profile-again.jsonl
# 9. SmolLM2-135M-Instruct (the default model) at b = 1, end to end, its profile measured by the
#    first run (var/profiles/smol-zen4.json).
S="--datastore var/demo-datastore/sharegpt-12000-ba75b552aebd --profile var/profiles/smol-zen4.json"
for set in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $set --prompts 16 --max-tokens 128 --batch-sizes 1 \
    --modes ar,sssd --policies measured,rule,fixed:8,fixed:16 --chunks 4 --hf-prompts 0 \
    --drafter inproc $S --png $R/e2e-smol-$set-b1.png 2> $R/e2e-smol-$set-b1.err \
    > $R/e2e-smol-$set-b1.jsonl
done
# 10. The products alone, as the memory's speed moved:
.venv/bin/python bench/linear_panels.py --model qwen-coder-1.5b --rows 1,2,4,6,8,12,16 \
  --out $R/linear-panels-qwen.jsonl
# 11. b = 8, 16 prompts x 64 tokens (2 chunks of 8).
for set in code mt_bench; do
  $E --set $set --prompts 16 --max-tokens 64 --batch-sizes 8 --modes ar,sssd \
    --policies measured,fixed:2 --chunks 2 --profile var/profiles/qwen-coder-1.5b/quiet-b8.json \
    --png $R/e2e-qwen-$set-b8.png 2> $R/e2e-qwen-$set-b8.err > $R/e2e-qwen-$set-b8.jsonl
done
