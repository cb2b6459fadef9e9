#!/usr/bin/env bash
# The checks that need a GPU, in one run: the engine's device tests on CUDA (exactness in float32
# and bfloat16 at the fixed verification shape, seeded and statistical sampling, one read-back
# per decode step, CUDA's synchronisation debug mode), then bench/e2e.py on CUDA in bfloat16.
#   bash scripts/gpu_check.sh [results-dir]        (default: bench/results/gpu-check)
# Needs the project installed (scripts/setup.sh) in a PyTorch with CUDA, and the ShareGPT
# datastore of the default model (built on first use, about a minute).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/gpu-check}
mkdir -p "$out"
python=${PYTHON:-python3}
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 1
"$python" -m pytest -q -rs -k cuda tests/verifier/engine/test_engine_devices.py \
  tests/verifier/engine/test_acceptance_sampling.py 2>&1 | tee "$out/pytest-cuda.log"
datastore=$("$python" - <<'PY'
from sssd.cli.datastores import ensure_sharegpt_datastore, default_data_dir
from sssd.common.model.tokenizer import load_tokenizer
print(ensure_sharegpt_datastore(default_data_dir(), load_tokenizer(None), 12000))
PY
)
"$python" bench/e2e.py --device cuda --dtype bfloat16 --set mt_bench --prompts 16 --max-tokens 64 \
  --batch-sizes 1,4,8 --modes ar,prompt_lookup,sssd --policies measured --datastore "$datastore" \
  --png "$out/e2e-cuda-bf16.png" | tee "$out/e2e-cuda-bf16.jsonl"
