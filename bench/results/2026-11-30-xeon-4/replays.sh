#!/usr/bin/env bash
# Replays of the measured policy (bench/policy_replay.py: timing-independent, the answers and
# the drafter real, step times from the cost table). Costs: the b = 1, 512-token run's.
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-4
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
C=1:158,2:159,4:164,8:167,16:181,32:223
Q=".venv/bin/python bench/policy_replay.py --model qwen-coder-1.5b --datastore $DS"
# 512-token MT-Bench answers, the policy started from the e2e run's (faster hour's) profile
$Q --sets mt_bench --max-tokens 512 --costs $C --seeds 1 \
  --profile var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json > $R/policy-replay-512-chat-stale-profile.jsonl
# a machine whose pace swings by +-15 % over a minute, against a steady one
for d in 0 0.15; do
  $Q --sets mt_bench,code --costs $C --seeds 4 --drift $d > $R/policy-replay-drift-$d.jsonl
done
# After the policy change (83eae90: budgets by what each adds beyond the next smaller one,
# settled budgets re-timed against the pace); the first run and the drift-0 run above are the
# same before it (19edf9b).
$Q --sets mt_bench,code --costs $C --seeds 4 > $R/policy-replay-increments-128.jsonl
$Q --sets mt_bench --max-tokens 512 --costs $C --seeds 1 \
  --profile var/profiles/qwen-coder-1.5b/e2e-forward-xeon.json \
  > $R/policy-replay-increments-512-chat-stale-profile.jsonl
# SmolLM2-135M (the default model), costs of this stop's SmolLM2 runs, noise +-10 %: before the
# change (19edf9b; only its two median lines were kept) and after it.
S=1:16,2:16.9,4:17.4,8:18.3,16:21.5,32:29.5
.venv/bin/python bench/policy_replay.py --datastore var/demo-datastore/sharegpt-12000-ba75b552aebd \
  --sets mt_bench,code --costs $S --seeds 4 --noise 0.1 > $R/policy-replay-smol-increments.jsonl
