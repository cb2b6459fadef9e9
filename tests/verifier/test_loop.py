"""What the engine loop streams as text: never something it has to take back."""

import pytest

from sssd.verifier.loop import EngineLoop
from sssd.verifier.sampling import SamplingParams
from sssd.verifier.sequence import Sequence


class TextOf:
    """decode(ids): the text is chosen by the test through the ids' count."""

    def __init__(self, texts):
        self.texts = texts

    def __call__(self, ids):
        return self.texts[len(ids)]


def seq_with(output_len, stop=(), finish=None, stop_text_len=None):
    seq = Sequence("r", [1], SamplingParams(), 100, tuple(stop))
    seq.output_ids = [5] * output_len
    seq.finish_reason = finish
    seq.stop_text_len = stop_text_len
    return seq


@pytest.mark.parametrize("text,stop,expected", [
    ("Hello wor", (), "Hello wor"),
    ("Hello \ufffd", (), "Hello "),  # half of a multi-byte character
    ("The END", ("ENDING",), "The "),  # "END" may still become the stop string
    ("The EN", ("END", "ENx"), "The "),
    ("The E", ("xyz",), "The E"),
])
def test_running_text_holds_back_what_may_change(text, stop, expected):
    loop = EngineLoop(engine=None, decode=TextOf({3: text}))
    assert loop._text(seq_with(3, stop)) == expected


def test_finished_text_is_cut_at_the_stop_string():
    loop = EngineLoop(engine=None, decode=TextOf({3: "The answer. END more"}))
    assert loop._text(seq_with(3, ("END",), "stop", stop_text_len=12)) == "The answer. "
    assert loop._text(seq_with(3, (), "length")) == "The answer. END more"
