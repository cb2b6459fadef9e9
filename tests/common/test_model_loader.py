"""Loading the target model, and the on-disk cache of its converted GGUF weights."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from sssd.common.model.files import resolve_model, save_atomically
from sssd.common.model.loader import LoadedModel, load_causal_lm, model_cache_dir
from sssd.common.model.tokenizer import tokenizer_cache_dir, tokenizer_fingerprint


@dataclasses.dataclass(frozen=True)
class Loads:
    """The default model loaded three times into one fresh cache directory."""

    cache_entry: Path
    converted: LoadedModel  # float32, converted from the GGUF (cold cache)
    cached: LoadedModel  # float32, from the cache the first load wrote
    cached_bf16: LoadedModel  # bfloat16, from the same cache


@pytest.fixture(scope="module")
def loads(tmp_path_factory, tokenizer):
    # One real GGUF conversion (about 15 s) into a private cache, so the user's cache is never
    # touched. The tokenizer's cache entry is copied over (the `tokenizer` fixture has filled
    # it), which spares its 6 s conversion; it is tested in test_tokenizer.py.
    files = resolve_model(None)
    real_tokenizer_dir = tokenizer_cache_dir(files)
    root = tmp_path_factory.mktemp("sssd-cache")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("SSSD_CACHE_DIR", str(root))
        if real_tokenizer_dir.is_dir():
            shutil.copytree(real_tokenizer_dir, tokenizer_cache_dir(files))
        cache_entry = model_cache_dir(files)
        assert not cache_entry.exists()
        converted = load_causal_lm(None, "float32")
        assert (cache_entry / "model.safetensors").is_file()
        return Loads(cache_entry=cache_entry, converted=converted,
                     cached=load_causal_lm(None, "float32"),
                     cached_bf16=load_causal_lm(None, "bfloat16"))


def test_first_load_converts_and_fills_the_cache_later_loads_read_it(loads):
    assert not loads.converted.from_cache
    assert loads.cached.from_cache and loads.cached_bf16.from_cache
    assert loads.cached.model.name_or_path == str(loads.cache_entry)
    marker = json.loads((loads.cache_entry / "sssd-complete").read_text())
    assert marker["dtype"] == "float32"
    assert marker["source"] == str(resolve_model(None).gguf_path)
    # Nothing but the finished entry: no temporary directory was left behind.
    assert [p.name for p in loads.cache_entry.parent.iterdir()] == [loads.cache_entry.name]


def test_cached_weights_equal_the_converted_ones_exactly(loads):
    converted = loads.converted.model.state_dict()
    cached = loads.cached.model.state_dict()
    assert converted.keys() == cached.keys()
    for name, tensor in converted.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(cached[name], tensor), name
    # The embedding stays tied to the output projection through the save and the reload.
    lm = loads.cached.model
    assert lm.get_output_embeddings().weight.data_ptr() == \
        lm.get_input_embeddings().weight.data_ptr()


def test_greedy_generation_is_identical_from_the_conversion_and_the_cache(loads):
    tokenizer = loads.converted.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]
    outputs = []
    for loaded in (loads.converted, loads.cached):
        with torch.inference_mode():
            # [1, num_tokens + 8]
            output_ids = loaded.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                               do_sample=False, max_new_tokens=8)
        outputs.append(output_ids[0, input_ids.shape[1]:].tolist())
    assert outputs[0] == outputs[1]
    assert len(outputs[0]) >= 1


def test_bfloat16_load_casts_the_float32_cache(loads):
    assert loads.cached_bf16.dtype == torch.bfloat16
    assert loads.cached_bf16.model.dtype == torch.bfloat16
    cached = loads.cached.model.state_dict()
    for name, tensor in loads.cached_bf16.model.state_dict().items():
        assert torch.equal(tensor, cached[name].to(torch.bfloat16)), name


def test_the_first_bfloat16_load_computes_like_every_later_one(tmp_path, tokenizer, monkeypatch):
    # A converted model cast with .to(bfloat16) once kept a rotary inv_freq buffer rounded from
    # float32, unlike a model built in bfloat16 from the cache: the first process after a cold
    # cache decoded differently (seen as 1946 against 2012 tokens on 16 MT-Bench prompts).
    files = resolve_model(None)
    real_tokenizer_dir = tokenizer_cache_dir(files)
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path))
    if real_tokenizer_dir.is_dir():
        shutil.copytree(real_tokenizer_dir, tokenizer_cache_dir(files))
    first = load_causal_lm(None, "bfloat16")
    later = load_causal_lm(None, "bfloat16")
    assert not first.from_cache and later.from_cache
    for kind in ("named_parameters", "named_buffers"):
        ours, theirs = dict(getattr(first.model, kind)()), dict(getattr(later.model, kind)())
        assert ours.keys() == theirs.keys()
        for name, tensor in ours.items():
            assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def test_model_facts_of_the_default_model(loads, tokenizer):
    loaded = loads.cached
    assert loaded.name == "SmolLM2-135M-Instruct.Q4_1"
    assert loaded.dtype == torch.float32
    # SmolLM2-Instruct closes every turn with <|im_end|>, its generation config's only eos id.
    assert loaded.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert loaded.model.generation_config.eos_token_id == loaded.eos_token_ids[0]
    assert loaded.vocab_size == len(tokenizer) == 49152
    assert loaded.fingerprint == tokenizer_fingerprint(tokenizer)
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.config._attn_implementation == "sdpa"
    assert loaded.model.device.type == "cpu"
    assert loaded.load_s > 0


def test_rejects_an_unsupported_dtype():
    with pytest.raises(ValueError, match="'float16' is not supported; allowed: bfloat16, float32"):
        load_causal_lm(None, "float16")


def test_rejects_a_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(tmp_path / "missing.gguf")


def test_rejects_a_directory_without_config_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")  # enough for a tokenizer, not for a model
    with pytest.raises(ValueError, match="no config.json"):
        load_causal_lm(tmp_path)


def _failing_write(directory):
    """Writes part of a checkpoint, then fails as a full disk or a kill would."""
    (Path(directory) / "model.safetensors").write_bytes(b"partial")
    raise OSError("No space left on device")


def _write(directory):
    (Path(directory) / "model.safetensors").write_bytes(b"complete")


def test_an_interrupted_save_leaves_no_entry(tmp_path):
    target = tmp_path / "models" / "digest"
    assert save_atomically(target, _failing_write) is False
    assert list((tmp_path / "models").iterdir()) == []


def test_a_save_replaces_an_unmarked_entry(tmp_path):
    target = tmp_path / "models" / "digest"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"partial")  # a crash before the marker
    assert save_atomically(target, _write)
    assert (target / "model.safetensors").read_bytes() == b"complete"
    assert (target / "sssd-complete").is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["digest"]


def test_a_save_keeps_a_complete_entry_another_process_wrote(tmp_path):
    target = tmp_path / "models" / "digest"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"theirs")
    (target / "sssd-complete").write_text("{}")
    save_atomically(target, _write)
    assert (target / "model.safetensors").read_bytes() == b"theirs"
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["digest"]
