#!/usr/bin/env bash
# Installs everything and runs the whole test suite. CI runs exactly this.
#   1. scripts/setup.sh, then pytest in .venv: every test (the vLLM engine tests skip there), on
#      two pytest-xdist workers (SSSD_TEST_WORKERS), then the tests marked `serial` (they
#      measure the machine) alone; why two workers and OMP_WAIT_POLICY=PASSIVE, how tests are
#      spread over them (tests/support/workers.py), and why a crashed worker ends the run
#      (--max-worker-restart 0): docs/development.md ("Tests");
#   2. scripts/setup_vllm.sh, then pytest in .venv-vllm: tests/vllm, where vLLM 0.32 (CPU build)
#      verifies drafts from the drafter service.
# Arguments go on to one plain pytest in .venv instead (no workers, no vLLM part): `bash
# scripts/test.sh -m "not model"` or `bash scripts/test.sh tests/drafter` run a part of the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
status=0
OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m pytest -q -n "${SSSD_TEST_WORKERS:-2}" \
  --max-worker-restart 0 -m "not serial" || status=$?
echo "[test] the tests marked serial, alone" >&2
.venv/bin/python -m pytest -q -m serial || status=$?
echo "[test] the vLLM tests, in .venv-vllm" >&2
bash scripts/setup_vllm.sh
.venv-vllm/bin/python -m pytest -q tests/vllm || status=$?
exit "$status"
