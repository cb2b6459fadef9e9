#!/usr/bin/env bash
# Long contexts and reuse (see NOTES.md): the engine on its paged KV cache against vLLM's CPU
# build, from the repository root, after scripts/setup.sh and scripts/setup_vllm.sh.
set -euo pipefail
R=bench/results/2026-12-02-zen4-long
DS=var/demo-datastore/sharegpt-12000-ba75b552aebd  # what `sssd up` builds for SmolLM2
# The current run: every part, the engine's default budget policy (measured).
.venv/bin/python -m bench.long_context --model smollm2 --datastore $DS \
  --lengths 2048,4096,8192 --code-prompts 8 --code-batches 1,4 \
  --out $R/long-context-smol.jsonl --png $R/long-context-smol.png 2> $R/long-context-smol.err
# Earlier the same session: the same with the rule policy (s_q = 16 at b = 1 whatever the
# context), then the code edits alone under the measured policy.
if [ "${EARLIER:-0}" = 1 ]; then
  .venv/bin/python -m bench.long_context --model smollm2 --datastore $DS \
    --lengths 2048,4096,8192 --code-prompts 8 --code-batches 1,4 --budget-policy rule \
    --out $R/long-context-smol-rule.jsonl --png $R/long-context-smol-rule.png \
    2> $R/long-context-smol-rule.err
  .venv/bin/python -m bench.long_context --model smollm2 --datastore $DS --systems engine \
    --parts code --code-prompts 8 --code-batches 1 \
    --out $R/long-context-smol-code-measured.jsonl \
    --png $R/long-context-smol-code-measured.png 2> $R/long-context-smol-code-measured.err
fi
# The machine's floors, and where a decode step's time goes at 300 and 8,000 tokens of context.
.venv/bin/python $R/peak.py > $R/peak.jsonl
for n in 300 8000; do .venv/bin/python $R/profile_decode.py $n; done > $R/profile-decode.jsonl
# Qwen2.5-Coder-1.5B (sssd-models fetch qwen-coder-1.5b), the engine alone: the code edits at
# b = 1 (4 files, 2.4k-3.3k tokens).
QDS=var/demo-datastore/sharegpt-12000-3f34145de91b  # what `sssd up` builds for its tokenizer
.venv/bin/python -m bench.long_context --model qwen-coder-1.5b --datastore $QDS \
  --systems engine --parts code --code-prompts 4 --code-batches 1 \
  --out $R/long-context-qwen-code.jsonl --png $R/long-context-qwen-code.png \
  2> $R/long-context-qwen-code.err
# The code edits again, vLLM's suffix method beside its ngram (after
# scripts/setup_vllm.sh --with-suffix).
.venv/bin/python -m bench.long_context --model smollm2 --datastore $DS --parts code \
  --code-prompts 8 --code-batches 1,4 --vllm-modes ar,ngram,suffix \
  --out $R/long-context-smol-code.jsonl --png $R/long-context-smol-code.png \
  2> $R/long-context-smol-code.err
