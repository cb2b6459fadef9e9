"""bench/http_peers.py's cell sizes and datasets (the servers and vLLM's client are run by the
benchmark itself, not here: they take minutes)."""

import json

import pytest

from bench import http_peers


def test_cells_grow_with_concurrency():
    assert http_peers.prompt_counts([1, 4, 8], 16, 8) == [16, 32, 64]
    assert http_peers.prompt_counts([1, 2], 16, 4) == [16, 16]


def test_a_limited_set_cuts_the_largest_cells_until_they_fit():
    assert http_peers.prompt_counts([1, 4, 8], 16, 8, limit=80) == [16, 32, 32]
    assert http_peers.prompt_counts([1, 4, 8], 40, 8, limit=80) == [26, 27, 27]
    with pytest.raises(SystemExit):
        http_peers.prompt_counts([1, 4, 8], 16, 8, limit=2)


def test_every_cell_gets_prompts_of_its_own(tmp_path):
    files = http_peers.write_datasets(tmp_path, [2, 3], [2, 3])
    sharegpt = [json.loads(path.read_text()) for path in files["sharegpt"]]
    assert [len(cell) for cell in sharegpt] == [4, 6]  # twice: the client drops some
    assert not {r["id"] for r in sharegpt[0]} & {r["id"] for r in sharegpt[1]}
    mt_bench = [path.read_text().splitlines() for path in files["mt_bench"]]
    assert [len(cell) for cell in mt_bench] == [2, 3]
    assert not set(mt_bench[0]) & set(mt_bench[1])
