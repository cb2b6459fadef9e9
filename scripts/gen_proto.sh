#!/usr/bin/env bash
# Generates the Python code of every .proto under proto/: messages (*_pb2.py), gRPC stubs
# (*_pb2_grpc.py) and typed stubs for both (*_pb2.pyi, *_pb2_grpc.pyi, by mypy-protobuf).
#
#   scripts/gen_proto.sh [OUT_DIR]     (default: services/v1, the package sssd.v1)
#
# proto/sssd/v1/x.proto becomes OUT_DIR/x_pb2.py (and the rest); their imports read
# `from sssd.v1 import ...`, which is the package services/v1. Stale generated files are removed
# first, so the output
# depends on proto/ and the pinned tool versions only. Never edit the output by hand;
# tests/common/test_proto_generated.py checks that the committed files match a fresh run.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-.venv/bin/python}"
out_dir="${1:-services/v1}"
# protoc-gen-mypy and protoc-gen-mypy_grpc are console scripts installed beside the interpreter.
bin_dir="$(dirname "$python")"

mapfile -t protos < <(find proto -name '*.proto' | LC_ALL=C sort)
if [[ ${#protos[@]} -eq 0 ]]; then
  echo "gen_proto.sh: no .proto files under proto/" >&2
  exit 1
fi

mkdir -p "$out_dir"
find "$out_dir" -type f \( -name '*_pb2.py' -o -name '*_pb2_grpc.py' -o -name '*_pb2.pyi' \
  -o -name '*_pb2_grpc.pyi' \) -delete

# protoc writes sssd/v1/... under its output directory (the proto path); only v1/ is kept.
work_dir="$(mktemp -d)"
trap 'rm -rf "$work_dir"' EXIT
PATH="$bin_dir:$PATH" "$python" -m grpc_tools.protoc -I proto \
  --python_out="$work_dir" \
  --grpc_python_out="$work_dir" \
  --mypy_out="$work_dir" \
  --mypy_grpc_out="$work_dir" \
  "${protos[@]}"
cp "$work_dir"/sssd/v1/*_pb2* "$out_dir"/
