#!/usr/bin/env bash
# llama.cpp's server beside the engine on SmolLM2-135M's GGUF, from the repository root after
# scripts/setup.sh and scripts/setup_llamacpp.sh. See NOTES.md.
set -euo pipefail
R=bench/results/2026-12-04-xeon-llamacpp
.venv/bin/python -m bench.llamacpp --lengths 2048,4096,8126 --repeats 2 --code-prompts 4 \
  --code-tokens 256 > $R/llamacpp.jsonl 2> $R/llamacpp.err
