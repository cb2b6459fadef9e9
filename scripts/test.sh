#!/usr/bin/env bash
# Installs everything and runs the whole test suite. CI runs exactly this.
#   1. scripts/setup.sh, then pytest in .venv: every test (the vLLM engine tests skip there);
#   2. scripts/setup_vllm.sh, then pytest in .venv-vllm: tests/vllm, where vLLM 0.32 (CPU build)
#      verifies drafts from the drafter service.
# The second part runs in the background while the first one's pytest runs (its set-up is mostly
# unpacking 3 GB of wheels, on the core that the main suite leaves idle about half the time); its
# output is printed when it ends, and either part failing fails the run.
# Arguments go on to the first pytest only, and skip the second: `bash scripts/test.sh -m "not
# model"` or `bash scripts/test.sh tests/drafter` run a part of the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
if [ "$#" -gt 0 ]; then
  .venv/bin/python -m pytest -q "$@" || status=$?
  exit "$status"
fi
mkdir -p var
VLLM_LOG=var/test-vllm.log
echo "[test] the vLLM part (scripts/setup_vllm.sh, then tests/vllm in .venv-vllm) runs in the" \
  "background; its log: $VLLM_LOG" >&2
# Its own process group (setsid), so that an interrupted run stops all of it.
setsid bash -c 'bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -q tests/vllm' \
  >"$VLLM_LOG" 2>&1 &
vllm_part=$!
trap 'kill -- -"$vllm_part" 2>/dev/null || true; exit 130' INT TERM
.venv/bin/python -m pytest -q || status=$?
echo "[test] the main suite ended (status $status); waiting for the vLLM part" >&2
vllm_status=0
wait "$vllm_part" || vllm_status=$?
echo "[test] the vLLM part (status $vllm_status), its log $VLLM_LOG:" >&2
grep -v "^WARNING: Location 'file://" "$VLLM_LOG" || true
[ "$vllm_status" -eq 0 ] || status=$vllm_status
exit "$status"
