# The measured budget policy after its re-timing changed (a capped step at every step instead of
# a rescale on a 3-step median) and budgets not yet settled stopped counting as far behind:
# bench/policy_engine.py with priced steps plus the machine's own recorded step-time scatter
# (2026-11-30-xeon-8/steps-smol-b1.json), SmolLM2-135M bfloat16, ShareGPT datastore (12,000
# records), 16 prompts x 128 tokens per set, b = 1, the costs of 2026-11-30-xeon-7.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=bench/results/2026-12-01-xeon-9
P="--profile var/profiles/smol-e2e-forward-xeon.json --datastore var/demo-datastore/sharegpt-12000-ba75b552aebd"
C="--sets code,mt_bench --prompts 16 --batch-size 1 --costs 1:18.3,2:20.6,4:21.1,8:22.2,16:24.1,32:31.5"
N="--step-noise bench/results/2026-11-30-xeon-8/steps-smol-b1.json"
# 1. In runs of 25 consecutive recorded steps (spells), six orders, as 2026-11-30-xeon-8's
#    noise-smol-b1-block25-6orders.jsonl:
.venv/bin/python bench/policy_engine.py $C --fixed 16 --orders 6 $P $N --noise-block 25 \
  > $R/noise-smol-b1-block25-6orders.jsonl
# 2. Step by step, three orders, as 2026-11-30-xeon-8's noise-smol-b1-block1.jsonl:
.venv/bin/python bench/policy_engine.py $C --fixed 16 --orders 3 $P $N > $R/noise-smol-b1-block1.jsonl
# 3. Without noise, three orders, fixed 16 only, as 2026-11-30-xeon-8's
#    priced-smol-b1-row-decays.jsonl (its row_decay=0.05 rows):
.venv/bin/python bench/policy_engine.py $C --fixed 16 --orders 3 $P > $R/priced-smol-b1-3orders.jsonl
# 4. End to end on the machine (real step times), after the change:
for set in code mt_bench; do
  .venv/bin/python bench/e2e.py --set $set --prompts 16 --max-tokens 128 --batch-sizes 1 --modes ar,sssd \
    --policies measured,fixed:16,fixed:8 --chunks 4 --hf-prompts 0 --drafter inproc $P \
    --png $R/e2e-smol-$set-b1.png 2> $R/e2e-smol-$set-b1.err > $R/e2e-smol-$set-b1.jsonl
done
# variant-no-top-exploration-*: the same commands before the last change (at the largest
#   budget the next smaller one is explored without waiting for hindsight), which end to end
#   ran code at budget 32 on 532 of 728 steps (e2e-smol-code-b1); before-e2e-code-b1.jsonl is
#   the code before this stop's changes, `--modes sssd --policies measured,fixed:16`, run
#   right after variant-no-top-exploration-e2e-code-b1.jsonl (the same command).
# Scratch variants (budget_policy constants read from the environment in a scratch copy, not in
# the tree; each line's file named after it; same commands as 1 and 2):
#   variant-rate25-clip40-*: re-timing at every step, rate 0.25, capped at 1.4x, nothing else;
#   variant-rate50-clip10-*: rate 0.5, capped at 1.1x (the adopted re-timing), nothing else;
#   variant-unsettled-close-alternate-pace9-*: as variant-no-top-exploration but a pace of 9.
#   variant-no-top-exploration's lines of 1 and 2, run from the tree, were byte-identical to
#   the scratch copy's run of the same settings (`cmp`).
