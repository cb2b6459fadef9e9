#!/usr/bin/env bash
cd /work/main
R=bench/results/2026-11-30-xeon-3
DS=var/demo-datastore/sharegpt-12000-3f34145de91b
PR=".venv/bin/python bench/policy_replay.py --model qwen-coder-1.5b --datastore $DS --sets code,mt_bench --seeds 4"
FAST=1:119,2:119,4:123,8:127,16:134,32:174
SLOW=1:142,2:145,4:150,8:153,16:161,32:209
for tie in 0.03 0.01; do
  $PR --costs $FAST --tie-tolerance $tie > $R/policy-replay-fast-tie$tie.jsonl 2>/dev/null
  $PR --costs $SLOW --tie-tolerance $tie > $R/policy-replay-slow-tie$tie.jsonl 2>/dev/null
done
$PR --costs $SLOW --profile bench/results/2026-11-30-xeon/busy-profile.json > $R/policy-replay-slow-busy-profile-tie0.01.jsonl 2>/dev/null
