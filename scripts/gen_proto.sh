#!/usr/bin/env bash
# Generates the Python code of every .proto under proto/: messages (*_pb2.py), gRPC stubs
# (*_pb2_grpc.py) and typed stubs for both (*_pb2.pyi, *_pb2_grpc.pyi, by mypy-protobuf).
#
#   scripts/gen_proto.sh [OUT_DIR]     (default: services/common/gen)
#
# Files land in OUT_DIR/sssd/v1/..., mirroring the proto packages; the generated imports read
# `from sssd.v1 import ...`, which resolves because services/common/gen/sssd/v1 is installed as
# the package sssd.v1 (CMakeLists.txt). Stale generated files are removed first, so the output
# depends on proto/ and the pinned tool versions only. Never edit the output by hand;
# tests/common/test_proto_generated.py checks that the committed files match a fresh run.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-.venv/bin/python}"
out_dir="${1:-services/common/gen}"
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

PATH="$bin_dir:$PATH" "$python" -m grpc_tools.protoc -I proto \
  --python_out="$out_dir" \
  --grpc_python_out="$out_dir" \
  --mypy_out="$out_dir" \
  --mypy_grpc_out="$out_dir" \
  "${protos[@]}"
