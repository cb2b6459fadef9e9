"""bench/e2e.py's per-prompt timing: the answers it decodes are the engine's, and each prompt's
time per output token (TPOT) is measured from its first token to its last."""

import sys

import pytest

from bench.e2e import decode_timed, tpot_speedups
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.factory import build_engine


def test_timed_decoding_gives_the_engines_answers_and_a_tpot_each(
        target_model_fp32, mt_bench_prompts, greedy_references):
    engine = build_engine(EngineConfig(mode="ar", budget_policy="rule", max_batch_size=2,
                                       max_len=512, dtype="float32"), target_model_fp32)
    prompts = mt_bench_prompts[:3]  # three prompts at batch 2: one waits for a free row
    outputs, tpots = decode_timed(engine, prompts, 12)
    assert outputs == [reference[:12] for reference in greedy_references[:3]]
    assert len(tpots) == 3 and all(t is not None and 0 < t < 10 for t in tpots)
    _, one_token = decode_timed(engine, prompts[:1], 1)
    assert one_token == [None]  # no token after the first: no TPOT


def test_tpot_speedups_pair_prompts_and_skip_untimed_ones():
    assert tpot_speedups([0.2, None, 0.3, 0.1], [0.1, 0.1, None, 0.05]) == \
        pytest.approx([2.0, 2.0])
    assert tpot_speedups([], []) == []


def test_a_datastore_of_another_tokenizer_stops_the_benchmark_before_it_measures(
        tmp_path, monkeypatch, capsys, target_model_fp32):
    """A drafter refuses such shards and drafts from each sequence's own tokens: the SSSD rows
    would be measured without the datastore they name (as on a GPU machine whose transformers
    fingerprinted the tokenizer differently)."""
    from bench import e2e
    from sssd.datastore.build import build_datastore

    build_datastore(tmp_path / "other", [[1, 2, 3, 4]], target_model_fp32.vocab_size, "e" * 64)
    monkeypatch.setattr(e2e, "load_causal_lm", lambda *args: target_model_fp32)
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--datastore", str(tmp_path / "other"),
                                      "--prompts", "1", "--batch-sizes", "1", "--hf-prompts", "0",
                                      "--png", str(tmp_path / "e2e.png")])
    with pytest.raises(SystemExit, match="built with another tokenizer"):
        e2e.main()
    assert capsys.readouterr().out == ""  # no row printed
