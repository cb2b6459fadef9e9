"""Tokenizer loading, its on-disk cache and the vocabulary fingerprint."""

import pytest

from sssd.common.model.files import resolve_model
from sssd.common.model.tokenizer import (
    load_tokenizer,
    tokenizer_cache_dir,
    tokenizer_fingerprint,
    vocab_size,
)

SAMPLE = "Hello, wörld!  def f(x):\n\treturn x ** 2  # 日本語 🙂"


def test_fingerprint_is_stable_across_loads(tokenizer):
    again = load_tokenizer()
    assert tokenizer is not again
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tokenizer)
    assert len(tokenizer_fingerprint(tokenizer)) == 64


def test_fingerprint_changes_with_the_vocabulary(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    modified = load_tokenizer(tmp_path)  # a Hugging Face directory loads directly
    assert tokenizer_fingerprint(modified) == tokenizer_fingerprint(tokenizer)
    modified.add_tokens(["<sssd-test-token>"])
    assert vocab_size(modified) == vocab_size(tokenizer) + 1
    assert tokenizer_fingerprint(modified) != tokenizer_fingerprint(tokenizer)


def test_vocab_size_counts_added_tokens(tokenizer):
    assert vocab_size(tokenizer) == len(tokenizer.get_vocab())
    assert vocab_size(tokenizer) > max(tokenizer.all_special_ids)


def test_second_load_comes_from_the_cache_and_encodes_the_same(tmp_path, monkeypatch):
    # One real conversion (about 6 s): the cached copy must tokenize exactly like the converted
    # tokenizer, or datastores built from a warm and a cold load would disagree.
    monkeypatch.setenv("SSSD_CACHE_DIR", str(tmp_path))
    files = resolve_model(None)
    cached_dir = tokenizer_cache_dir(files)
    assert not cached_dir.exists()

    converted = load_tokenizer()
    assert (cached_dir / "tokenizer.json").is_file()
    cached = load_tokenizer()
    assert cached.name_or_path == str(cached_dir)

    assert tokenizer_fingerprint(cached) == tokenizer_fingerprint(converted)
    assert cached.encode(SAMPLE) == converted.encode(SAMPLE)
    messages = [{"role": "user", "content": SAMPLE}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        converted.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_rejects_what_is_neither_a_gguf_nor_a_model_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match="hub ids"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
