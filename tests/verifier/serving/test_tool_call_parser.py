"""The tool-call parser alone: an answer fed in any split streams the same calls and content as
the answer parsed whole; a call's name goes out before its arguments end, its arguments in
fragments; what is not a call stays text."""

import json
import random

import pytest

from sssd.verifier.serving.http_api.tool_calls import ToolCallParser

WRITE = ('<tool_call>\n{"name": "write_file", "arguments": {"path": "a.py", "content": '
         '"def f():\\n    return {\\"k\\": 1}\\n"}}\n</tool_call>')
ANSWERS = [
    "Let me look.\n" + WRITE,
    WRITE + "\n" + WRITE.replace("a.py", "b.py"),
    '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',
    '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>',
    "No call here, only a <tool_call> tag in words.",
    '<tool_call>\nnot json at all\n</tool_call> and text after',
    'A brace } and </tool_ in text',
]


def streamed(parser, answer, rng):
    """The answer fed in random pieces: the deltas, and (content, calls as (name, arguments))."""
    deltas, position = [], 0
    while position < len(answer):
        size = rng.randint(1, 7)
        piece, position = answer[position: position + size], position + size
        deltas += parser.feed(piece, final=False)
    deltas += parser.feed("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    calls = {}
    for delta in deltas:
        for call in delta.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call["function"]["arguments"]
    return deltas, content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_stream_in_any_split_equals_the_whole_answer(answer):
    content, calls = ToolCallParser(names=("get_weather",)).parse_whole(answer)
    whole = [(c.name, c.arguments) for c in calls]
    for seed in range(20):
        parser = ToolCallParser(names=("get_weather",))
        _, streamed_content, streamed_calls = streamed(parser, answer, random.Random(seed))
        assert streamed_calls == whole == [(c.name, c.arguments) for c in parser.calls]
        assert streamed_content.strip() == (content or "").strip()
    for name, arguments in whole:
        assert isinstance(json.loads(arguments), dict) and name


def test_the_name_goes_out_before_the_arguments_end_and_they_come_in_fragments():
    parser = ToolCallParser()
    head = WRITE[: WRITE.index('"content"')]
    deltas = parser.feed(head, final=False)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "write_file", "arguments": ""}
    assert deltas[0]["tool_calls"][0]["id"].startswith("call_")
    sent = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert sent == '{"path": "a.py",'  # trailing space held: it might precede the end
    rest = parser.feed(WRITE[len(head):], final=True)
    arguments = sent + "".join(d["tool_calls"][0]["function"]["arguments"] for d in rest)
    assert json.loads(arguments)["content"] == 'def f():\n    return {"k": 1}\n'
    assert parser.calls[0].arguments == arguments


def test_a_forced_call_without_its_closing_tag_is_a_call():
    parser = ToolCallParser(prefix="<tool_call>\n")
    answer = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    _, content, calls = streamed(parser, answer, random.Random(0))
    assert calls == [("get_weather", '{"city": "Oslo"}')] and content == ""


def test_a_call_cut_off_streams_as_far_as_it_got_and_is_not_a_call():
    parser = ToolCallParser()
    cut = WRITE[: WRITE.index("return")]  # max_tokens ends the answer inside the arguments
    _, content, calls = streamed(parser, cut, random.Random(0))
    assert calls and calls[0][0] == "write_file" and content == ""
    assert parser.calls == []  # the response's calls hold only whole ones
    assert ToolCallParser().parse_whole(cut) == (cut, [])
