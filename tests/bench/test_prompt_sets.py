"""The code-edit prompt sets: the benchmark's files and the tuning set never overlap."""

from bench.prompt_sets import CODE_EDIT_FILES, code_edits, prompt_texts


def test_the_tuning_files_come_after_the_benchmarks(tokenizer):
    benchmark = code_edits(tokenizer, CODE_EDIT_FILES)
    tuning = code_edits(tokenizer, 3, skip=CODE_EDIT_FILES)
    assert len(benchmark) == CODE_EDIT_FILES and len(tuning) == 3
    assert not {f for f, _, _ in benchmark} & {f for f, _, _ in tuning}
    assert [f for f, _, _ in code_edits(tokenizer, CODE_EDIT_FILES + 3)] == \
        [f for f, _, _ in benchmark + tuning]
    for _, text, ids in benchmark + tuning:
        expected = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True)
        assert ids == list(getattr(expected, "input_ids", expected))
        assert 2048 <= len(ids) <= 16384
    assert prompt_texts("code-edits-tune", 3, tokenizer) == [t for _, t, _ in tuning]


def test_a_code_edit_set_needs_the_tokenizer():
    import pytest

    with pytest.raises(SystemExit, match="needs the model's tokenizer"):
        prompt_texts("code-edits", 2)
