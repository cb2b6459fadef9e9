"""Incremental detokenization and stop strings: the text streamed is never taken back, equals
a full decode, and costs the same per token however long the answer is."""

import numpy as np
import pytest

from sssd.verifier.engine.detokenizer import IncrementalDetokenizer, find_stop, stream_safe_end
from sssd.verifier.engine.request import GenerateRequest
from sssd.verifier.engine.sequence import Sequence


class ByteTokens:
    """decode(ids): every id is one byte of UTF-8 (what a byte-level tokenizer's tokens are at
    worst); counts the ids it decodes."""

    def __init__(self):
        self.decoded = 0

    def __call__(self, ids):
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text,stop,expected", [
    ("Hello wor", (), "Hello wor"),
    ("The END", ("ENDING",), "The "),  # "END" may still become the stop string
    ("The EN", ("END", "ENx"), "The "),
    ("The E", ("xyz",), "The E"),
])
def test_running_text_holds_back_what_may_change(text, stop, expected):
    assert text[: stream_safe_end(text, stop)] == expected


def test_half_a_character_is_never_in_the_text():
    detokenizer = IncrementalDetokenizer(ByteTokens())
    detokenizer.append(list("Hello ".encode()))
    euro = list("€".encode())  # three bytes
    assert detokenizer.append(euro[:2]) == "" and detokenizer.text == "Hello "
    assert detokenizer.append(euro[2:]) == "€" and detokenizer.text == "Hello €"


def test_finished_text_is_cut_at_the_stop_string():
    seq = Sequence("r", GenerateRequest((1,), 100, stop=("END",)),
                   detokenizer=IncrementalDetokenizer(ByteTokens()))
    seq.detokenizer.append(list(b"The answer. END more"))
    seq.stop_text_len = find_stop(seq.detokenizer.text, ("END",), 0)
    assert seq.stop_text_len == 12 and seq.text == "The answer. "
    plain = Sequence("r", GenerateRequest((1,), 100),
                     detokenizer=IncrementalDetokenizer(ByteTokens()))
    plain.detokenizer.append(list(b"The answer. END more"))
    assert plain.text == "The answer. END more"


def test_find_stop_looks_only_where_a_new_match_can_end():
    text = "abc END xyz STOP"
    assert find_stop(text, ("END", "STOP"), 0) == 4
    assert find_stop(text, ("STOP",), len(text) - 1) == 12  # the match ends in the new part
    assert find_stop(text, ("END",), 10) is None  # an older match is not searched again


def test_random_bytes_decode_like_a_full_decode_at_constant_cost():
    rng = np.random.default_rng(0)
    pieces = ["a", " b", "é", "€", "😀", "\n", "xyz"]
    text = "".join(rng.choice(pieces, size=3000))
    ids = list(text.encode())
    decode = ByteTokens()
    detokenizer = IncrementalDetokenizer(decode)
    position = 0
    while position < len(ids):  # steps of 1-5 tokens, as verification steps emit
        step = int(rng.integers(1, 6))
        detokenizer.append(ids[position: position + step])
        assert text.startswith(detokenizer.text)
        position += step
    detokenizer.flush()
    assert detokenizer.text == text
    # Each window spans two appends: at most ~10 ids decoded per id, whatever the length.
    assert decode.decoded < 12 * len(ids)


def test_a_stray_byte_at_the_end_stays_as_a_full_decode_has_it():
    detokenizer = IncrementalDetokenizer(ByteTokens())
    detokenizer.append(list("ok ".encode()) + [0xE2])  # the first byte of a 3-byte character
    assert detokenizer.text == "ok "
    detokenizer.flush()
    assert detokenizer.text == bytes(list("ok ".encode()) + [0xE2]).decode(errors="replace")


def test_real_outputs_decode_like_the_tokenizer(target_model_fp32, greedy_references):
    tokenizer = target_model_fp32.tokenizer

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    rng = np.random.default_rng(1)
    for output in greedy_references:
        detokenizer = IncrementalDetokenizer(decode)
        position = 0
        while position < len(output):
            step = int(rng.integers(1, 5))
            detokenizer.append(output[position: position + step])
            position += step
        detokenizer.flush()
        assert detokenizer.text == decode(output)
