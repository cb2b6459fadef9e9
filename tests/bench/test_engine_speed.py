"""bench/engine_speed.py end to end on the default model, its smallest run: each system in its
own process, JSON lines, the same tokens as the engine, the PNG (vLLM is left out here: its
environment is .venv-vllm, which tests/vllm covers)."""

import json
from pathlib import Path

import pytest

from bench import engine_speed


@pytest.mark.model
def test_the_smallest_run_prints_a_row_per_system(tmp_path, capsys):
    out = tmp_path / "speed.jsonl"
    engine_speed.main(["--models", "smollm2", "--dtypes", "float32", "--batch-sizes", "2",
                       "--prompts", "2", "--max-tokens", "6", "--systems",
                       "engine,engine-transformers,generate", "--speculative", "",
                       "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["system"] for r in rows] == ["engine", "engine-transformers", "generate"]
    engine = rows[0]
    assert engine["impl"] == "sssd" and rows[1]["impl"] == "transformers"
    assert engine["ms_per_step"] > 0 and engine["floor_ms_per_step"] > 0
    for row in rows:
        assert row["num_tokens"] > 0 and row["tokens_per_s"] > 0
        assert row["batch_size"] == 2 and row["dtype"] == "float32"
    # float32: the three decode the same tokens
    assert rows[1]["identical_to_engine"] is True and rows[2]["identical_to_engine"] is True
    assert out.with_suffix(".png").stat().st_size > 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("{")]
    assert printed == rows


def test_unknown_systems_are_refused():
    with pytest.raises(SystemExit):
        engine_speed.main(["--systems", "engine,sglang"])


@pytest.mark.model
def test_engine_sssd_drafts_from_a_datastore_named_by_a_relative_path(tmp_path, warm_datastore,
                                                                      monkeypatch):
    # The workers run in a temporary folder: a relative --datastore once named nothing there,
    # and engine-sssd drafted from each sequence's own tokens alone (about 1.05 tokens a step).
    monkeypatch.chdir(Path(warm_datastore).parent)
    out = tmp_path / "speed.jsonl"
    engine_speed.main(["--models", "smollm2", "--dtypes", "float32", "--batch-sizes", "1",
                       "--prompts", "1", "--max-tokens", "24", "--systems", "engine",
                       "--speculative", "engine-sssd", "--policy", "rule",
                       "--datastore", Path(warm_datastore).name, "--out", str(out)])
    rows = {r["system"]: r for r in map(json.loads, out.read_text().splitlines())}
    # The datastore holds the model's own answer to this prompt: most of it is accepted.
    assert rows["engine-sssd"]["tokens_per_step"] > 2.0
    assert rows["engine-sssd"]["identical_to_engine"] is True
