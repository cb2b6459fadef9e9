"""bench/prefill.py on the default model, its smallest run: both engine systems in their own
processes (vLLM is left out: its environment is .venv-vllm), one JSON line each per length,
naming the attention path the prompts ran."""

import json

import pytest
import torch

from bench import prefill
from sssd.common.model import kernel_paths


@pytest.mark.model
def test_the_smallest_run_prints_a_row_per_system_and_length(tmp_path):
    out = tmp_path / "prefill.jsonl"
    prefill.main(["--models", "smollm2", "--lengths", "70,130", "--repeats", "1", "--rounds",
                  "1", "--systems", "engine,engine-whole", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["length"], r["system"]) for r in rows] == [
        (70, "engine"), (70, "engine-whole"), (130, "engine"), (130, "engine-whole")]
    for row in rows:
        assert row["ms"] > 0 and row["tokens_per_s"] > 0 and "speed_vs_vllm" not in row
    path = kernel_paths.path("tree_attention", torch.bfloat16)
    assert {r["system"]: r["attention"] for r in rows} == {"engine": path, "engine-whole": path}


def test_unknown_systems_and_lengths_are_refused():
    with pytest.raises(SystemExit, match="unknown systems"):
        prefill.main(["--systems", "engine,sglang"])
    with pytest.raises(SystemExit, match="positive"):
        prefill.main(["--systems", "engine", "--lengths", "0"])
