#!/usr/bin/env bash
# Installs everything and runs the whole test suite. CI runs exactly this.
#   1. scripts/setup.sh, then pytest in .venv: every test (the vLLM engine tests skip there);
#   2. scripts/setup_vllm.sh, then pytest in .venv-vllm: tests/vllm, where vLLM 0.32 (CPU build)
#      verifies drafts from the drafter service.
# Arguments go on to the first pytest only, and skip the second: `bash scripts/test.sh -m "not
# model"` or `bash scripts/test.sh tests/drafter` run a part of the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
if [ "$#" -gt 0 ]; then
  exit "$status"
fi
echo "[test] the vLLM tests, in .venv-vllm" >&2
bash scripts/setup_vllm.sh
.venv-vllm/bin/python -m pytest -q tests/vllm || status=$?
exit "$status"
