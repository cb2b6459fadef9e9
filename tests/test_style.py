"""The sources read as the project's style asks: lines of at most 100 columns, no unused imports
or names, imports sorted (ruff, configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.fail("ruff is missing: scripts/setup.sh installs it (the dev extra)")
    done = subprocess.run([ruff, "check", "--output-format", "concise", "services", "tests",
                           "bench", "setup.py"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
