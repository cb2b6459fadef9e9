"""`sssd-self-outputs`: the model's own ShareGPT answers, resumable, and a datastore from them."""

import json

import pytest
import torch

from sssd.cli.self_outputs import build, check_model, generate, read_outputs
from sssd.datastore.manifest import read_manifest


def test_generate_resumes_and_builds_a_datastore(tmp_path, target_model_fp32):
    added = generate(tmp_path, target_model_fp32, start=0, stop=3, max_tokens=6, batch_size=2,
                     max_prompt_tokens=512)
    records = list(read_outputs(tmp_path / "outputs.jsonl"))
    assert sorted(r["record"] for r in records) == [0, 1, 2]
    answered = [r for r in records if "output_ids" in r]
    assert added == len(answered) >= 1
    # Each answer is plain greedy decoding of its prompt.
    model = target_model_fp32.model
    first = answered[0]
    with torch.inference_mode():
        reference = model.generate(torch.tensor([first["prompt_ids"]]), do_sample=False,
                                   max_new_tokens=6)[0, len(first["prompt_ids"]):].tolist()
    assert first["output_ids"] == reference

    # A writer killed mid-line leaves a torn record: it is ignored, then cut before appending.
    with open(tmp_path / "outputs.jsonl", "a") as f:
        f.write('{"record": 99, "prompt_')
    assert len(list(read_outputs(tmp_path / "outputs.jsonl"))) == 3
    # Resuming does only the new records.
    generate(tmp_path, target_model_fp32, start=0, stop=5, max_tokens=6, batch_size=2,
             max_prompt_tokens=512)
    lines = (tmp_path / "outputs.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["record"] for line in lines) == [0, 1, 2, 3, 4]

    answered = [r for r in read_outputs(tmp_path / "outputs.jsonl") if "output_ids" in r]
    datastore = build(tmp_path, len(answered))
    manifest = read_manifest(datastore)
    assert manifest is not None and len(manifest.shards) == 1
    meta = json.loads((datastore / manifest.shards[0] / "meta.json").read_text())
    # One document per conversation, each followed by a separator token in the stream.
    assert meta["num_tokens"] == sum(len(r["prompt_ids"]) + len(r["output_ids"]) + 1
                                     for r in answered)
    assert meta["tokenizer_fingerprint"] == target_model_fp32.fingerprint
    assert meta["origin"] == "model"  # the drafter weights the model's own answers
    # With ShareGPT records as they are, in a corpus shard before the answers.
    combined = build(tmp_path, len(answered), sharegpt_records=2)
    assert combined.name == f"datastore-{len(answered)}+sharegpt2"
    manifest = read_manifest(combined)
    metas = [json.loads((combined / name / "meta.json").read_text()) for name in manifest.shards]
    assert [(m["origin"], m["num_documents"]) for m in metas] == [("corpus", 2),
                                                                  ("model", len(answered))]
    with pytest.raises(SystemExit, match="only"):
        build(tmp_path, len(answered) + 1)


def test_long_prompts_are_skipped_and_recorded(tmp_path, target_model_fp32):
    generate(tmp_path, target_model_fp32, start=0, stop=2, max_tokens=8, batch_size=2,
             max_prompt_tokens=8)
    records = list(read_outputs(tmp_path / "outputs.jsonl"))
    assert [r.get("skipped") for r in records] == ["no user turn or prompt too long"] * 2


def test_a_directory_holds_one_models_answers(tmp_path, target_model_fp32):
    check_model(tmp_path, "fingerprint-a", "model-a")  # the first use records it
    check_model(tmp_path, "fingerprint-a", "model-a")
    with pytest.raises(SystemExit, match="another tokenizer.*its own --dir"):
        check_model(tmp_path, "fingerprint-b", "model-b")
    # generate refuses before it answers anything, build before it writes a shard
    with pytest.raises(SystemExit, match="another tokenizer"):
        generate(tmp_path, target_model_fp32, start=0, stop=1, max_tokens=2, batch_size=1,
                 max_prompt_tokens=64)
    (tmp_path / "outputs.jsonl").write_text(
        json.dumps({"record": 0, "prompt_ids": [1, 2], "output_ids": [3]}) + "\n")
    with pytest.raises(SystemExit, match="another tokenizer"):
        build(tmp_path, 1)
    assert not list(tmp_path.glob("datastore-*"))
