"""The committed generated proto code is exactly what scripts/gen_proto.sh makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "services" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", "_pb2_grpc.pyi")


def _generated_files(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name.endswith(GENERATED_SUFFIXES)
    }


def test_committed_generated_code_matches_a_fresh_run(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        capture_output=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    fresh = _generated_files(tmp_path)
    committed = _generated_files(COMMITTED)

    assert fresh, "gen_proto.sh generated nothing"
    assert sorted(committed) == sorted(fresh), "run scripts/gen_proto.sh: the file sets differ"
    stale = [name for name in fresh if committed[name] != fresh[name]]
    assert not stale, f"run scripts/gen_proto.sh: {stale} differ from proto/"

