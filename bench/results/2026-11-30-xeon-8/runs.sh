# The measured budget policy in the engine with priced steps (bench/policy_engine.py), and the
# same with the machine's own step-time scatter added to every priced step. SmolLM2-135M
# bfloat16, ShareGPT datastore (12,000 records), 16 prompts x 128 tokens per set, b = 1, the
# costs of 2026-11-30-xeon-7 (full-step ms at each fixed budget, bench/e2e.py).
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/2026-11-30-xeon-8
P="--profile var/profiles/smol-e2e-forward-xeon.json --datastore var/demo-datastore/sharegpt-12000-ba75b552aebd"
C="--sets code,mt_bench --prompts 16 --batch-size 1 --costs 1:18.3,2:20.6,4:21.1,8:22.2,16:24.1,32:31.5"
# 1. The real seconds of every timed step, recorded while the configurations ran (one order):
#    steps-smol-b1.json. Run with a scratch variant that also had a measured policy pricing the
#    slow tail (below), before the fix of the warm-up; its fixed-budget steps are what any run
#    records.
.venv/bin/python bench/policy_engine.py $C --fixed 8,16 --orders 1 $P --record-steps $R/steps-smol-b1.json
# 2. No noise, after the fix (the policy starts afresh after the engine's warm-up): run twice,
#    byte-identical lines (`cmp`); priced-smol-b1-run1.jsonl. (Its tail=off row is the policy
#    as it is: the scratch tail variant is not in the tree.)
.venv/bin/python bench/policy_engine.py $C --fixed 8,16 --orders 1 $P > $R/priced-smol-b1-run1.jsonl
# 3. The recorded scatter drawn step by step (iid), 3 orders: noise-smol-b1-tail.jsonl holds the
#    default ("tail=off", the policy in the tree) and the scratch variant that priced every
#    budget at its median plus the mean excess of the last 256 settled steps ("measured:
#    row_decay=0.05", dropped); noise-smol-b1-retime9.jsonl and noise-smol-b1-settle25.jsonl
#    are scratch runs with budget_policy's constants patched (re-timing on the median of 9
#    steps at 5 % instead of 3 at 10 %; settling on 25 steps instead of 9), fixed 16 only.
#    (run with the scratch variant's extra option --price-tails on,off, not in the tree)
.venv/bin/python bench/policy_engine.py $C --fixed 8,16 --orders 3 $P --step-noise $R/steps-smol-b1.json \
  > $R/noise-smol-b1-tail.jsonl
# 4. The recorded scatter drawn in runs of consecutive steps (spells), against single steps:
for k in 1 25; do
  .venv/bin/python bench/policy_engine.py $C --fixed 8,16 --orders 3 $P \
    --step-noise $R/steps-smol-b1.json --noise-block $k > $R/noise-smol-b1-block$k.jsonl
done
# 5. The row_decay comparison of 2026-11-30-xeon-7, again after the fix, without noise:
.venv/bin/python bench/policy_engine.py $C --fixed 8,16 --row-decays 0.1,0.05 --orders 3 $P \
  > $R/priced-smol-b1-row-decays.jsonl
# 6. Scratch: budget_policy.RESETTLE patched to 0.2 (a scratch wrapper setting the module
#    constant, then calling policy_engine.main), --fixed 16, in runs of 25 steps
#    (noise-smol-b1-block25-resettle20.jsonl) and step by step (noise-smol-b1-resettle20.jsonl).
# 7. Six orders in runs of 25 steps, --fixed 16, the default (RESETTLE 0.1, through the same
#    scratch wrapper) and RESETTLE 0.2: noise-smol-b1-block25-6orders{,-resettle20}.jsonl
#    (orders 0-2 repeat the 3-order runs' lines exactly).
