"""bench/long_context.py on the default model, its smallest run: the engine alone (vLLM's
environment is .venv-vllm), plain decoding and prompt lookup, each in its own process, every part
at a few hundred tokens."""

import json

import pytest

from bench import long_context


@pytest.mark.model
def test_the_smallest_run_measures_every_part_and_checks_the_answers(tmp_path):
    out = tmp_path / "long.jsonl"
    long_context.main([
        "--systems", "engine", "--modes", "ar,prompt_lookup", "--lengths", "300",
        "--repeats", "1", "--decode-tokens", "4", "--prefix-tokens", "256",
        "--conversations", "1", "--turn-tokens", "4", "--code-prompts", "2",
        "--code-min-tokens", "200", "--code-max-tokens", "900", "--code-tokens", "8",
        "--code-batches", "1,2", "--streams", "12", "--budget-policy", "rule",
        "--out", str(out), "--png", str(tmp_path / "long.png")])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    parts = {(r["mode"], r["part"]) for r in rows}
    assert {("ar", p) for p in ("lengths", "prefix", "turns", "code", "code-batch",
                                "streams", "code-summary")} <= parts
    assert ("prompt_lookup", "lengths") not in parts  # plain decoding's measures once
    (length,) = [r for r in rows if r["part"] == "lengths"]
    assert length["length"] == 300 and length["ttft_s"] > 0 and length["decode_tok_s"] > 0
    (prefix,) = [r for r in rows if r["part"] == "prefix"]
    assert prefix["warm_ttft_s"] < prefix["cold_ttft_s"]  # 256 of 320 tokens cached
    turns = [r for r in rows if r["part"] == "turns"]
    assert [r["turn"] for r in turns] == list(range(len(turns))) and len(turns) >= 4
    code = [r for r in rows if r["part"] in ("code", "code-batch")]
    assert len(code) == 2 * 3
    looked_up = [r for r in code if r["mode"] == "prompt_lookup"]
    assert [r["same_as_ar"] for r in looked_up] == [True] * 3  # 2 alone, 1 batch of 2
    assert all("same_as_ar" not in r for r in code if r["mode"] == "ar")  # the reference
    summaries = {(r["mode"], r["batch"]): r for r in rows if r["part"] == "code-summary"}
    assert summaries[("prompt_lookup", 1)]["same_as_ar"] == "2 / 2"
    assert summaries[("prompt_lookup", 2)]["same_as_ar"] == "1 / 1"
    assert summaries[("ar", 1)]["median_speedup"] == 1.0
    (streams,) = [r for r in rows if r["part"] == "streams"]
    assert streams["failed"] == 0 and streams["requests"] == 12
    assert streams["most_running"] == 12  # all admitted at once
    assert all(r["kv_bytes_per_token"] > 0 for r in rows if r["part"] == "lengths")
    assert (tmp_path / "long.png").stat().st_size > 0


def test_speculation_by_sssd_needs_a_datastore():
    with pytest.raises(SystemExit, match="needs --datastore"):
        long_context.main(["--systems", "engine", "--modes", "ar,sssd"])


def test_a_mode_without_plain_decoding_in_the_run_claims_no_speedup():
    args = long_context.argparse.Namespace(model="smollm2", dtype="bfloat16", code_batches="1")
    run = {"rows": [{"part": "code", "file": "f.py", "tok_s": 50.0, "output": [1, 2]}],
           "facts": {}}
    rows = long_context.summarize(args, {("engine", "sssd"): run})
    (summary,) = [r for r in rows if r["part"] == "code-summary"]
    assert "median_speedup" not in summary and "same_as_ar" not in summary
    assert "speedup" not in rows[0] and "same_as_ar" not in rows[0]
