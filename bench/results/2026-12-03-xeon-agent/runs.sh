#!/usr/bin/env bash
# The agentic tool-calling sessions (see NOTES.md), from the repository root after
# scripts/setup.sh: two `sssd serve` processes of Qwen2.5-Coder-0.5B (speculation auto / off),
# six sessions of at most 10 model calls each, 1,024 tokens per call.
set -euo pipefail
R=bench/results/2026-12-03-xeon-agent
.venv/bin/python -m bench.agent --out $R/agent.jsonl --png $R/agent.png 2> $R/agent.err
