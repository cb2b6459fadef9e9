"""`sssd-compare`, one prompt in process: a real drafter service, the engine, the comparison."""

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sssd.cli.compare", *args],
                          capture_output=True, text=True, timeout=300)


def test_answers_and_reports_the_speedup(warm_datastore, mt_bench_prompts):
    # float32: speculative and plain greedy decoding must agree exactly, so the CLI's
    # comparison line is checked too.
    result = run_cli("Give me three tips for writing clear emails.", "--max-tokens", "24",
                     "--dtype", "float32", "--datastore", warm_datastore)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "drafter service on 127.0.0.1:" in out
    assert "tokens per verification step" in out
    assert "outputs identical" in out
    speedup = float(out.rsplit("speedup over autoregressive:", 1)[1].strip().rstrip("x"))
    assert speedup > 0


@pytest.mark.parametrize("args,message", [
    (["   "], "the prompt is empty"),
    (["hi", "--max-tokens", "0"], "--max-tokens must be >= 1"),
])
def test_bad_arguments_are_refused(args, message):
    result = run_cli(*args)
    assert result.returncode == 2 and message in result.stderr


def test_missing_datastore_is_refused(tmp_path):
    result = run_cli("hi", "--datastore", str(tmp_path / "nowhere"))
    assert result.returncode == 1 and "holds no datastore" in result.stderr
