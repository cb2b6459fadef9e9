#!/usr/bin/env bash
# The measured policy by replay (bench/policy_replay.py) with the step costs of this day's b = 1
# runs after the row kernels and AMX scores (2026-11-30-xeon-5: AR 166, 4: 169, 8: 169, 16: 178,
# 32: 237 ms): a quiet profile, the busy profile served on a quiet machine, and the reverse.
set -u
cd /work/main
R=bench/results/2026-11-30-xeon-6
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
C=1:166,2:166,4:169,8:169,16:178,32:237
B=1:478,2:478,4:504,8:522,16:549,32:728
Q=".venv/bin/python bench/policy_replay.py --model qwen-coder-1.5b --datastore $DS --sets code,mt_bench --seeds 4"
$Q --costs $C > $R/policy-replay-quiet.jsonl
$Q --costs $C --profile bench/results/2026-11-30-xeon/busy-profile.json > $R/policy-replay-busy-profile.jsonl
$Q --costs $B > $R/policy-replay-busy-machine.jsonl
