"""Tool calls in the chat API: the model's format chosen from its chat template, the calls
parsed from its output (whole, or incrementally while streaming), and the prompt prefix that
forces a call for `tool_choice` "required" or a named function.

One format exists here: Hermes' / Qwen2.5's, which the Qwen2.5 templates render (the tools
inside <tools></tools> in the system prompt) and whose models answer

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, after optional text. For tool_choice "required" or a named function
the prompt ends with the opening tag and a grammar holds the call to the tools' schemas.
The smaller Qwen2.5-Coder models often drop the tags and answer with the bare object; an
answer that is nothing but such an object naming one of the request's tools is taken as that
call too (streamed, an answer that opens with "{" is held back until it ends, to tell). A
template without the format has no tool parser here, and `tools` on such a model is refused
by name (no guessing from another family's markers).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from sssd.verifier.engine.errors import InvalidRequest
from sssd.verifier.engine.grammar import FIELDS, Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_format(tokenizer) -> str | None:
    """The model's tool-call format ("hermes"), or None where its chat template has none."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates: the default, or the tool-use one
        template = template.get("tool_use") or template.get("default") or ""
    return "hermes" if OPEN in template and "tools" in template else None


def forced_prefix(tool_choice: object) -> str:
    """Text the answer starts with, put at the end of the prompt, for tool_choice "required" or
    a named function: the call's opening tag; the parser reads the answer as if the model had
    written it. The call itself is held to `forced_call_schema` by a grammar."""
    return OPEN + "\n" if tool_choice == "required" or isinstance(tool_choice, dict) else ""


def forced_call_schema(tools: list[dict], tool_choice: object) -> dict | None:
    """The JSON schema a forced call matches: {"name": one of the tools (the named one),
    "arguments": that tool's parameters}, as vLLM holds required and named calls to their
    tools' schemas by guided decoding; None for "auto" and "none". A small model left free
    after the tag names functions that do not exist."""
    if tool_choice == "required":
        chosen = [tool["function"] for tool in tools]
    elif isinstance(tool_choice, dict):
        chosen = [tool["function"] for tool in tools
                  if tool["function"]["name"] == tool_choice["function"]["name"]]
    else:
        return None
    options = [{"type": "object", "properties": {
        "name": {"const": function["name"]},
        "arguments": function.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False}
        for function in chosen]
    return options[0] if len(options) == 1 else {"anyOf": options}


def answer_grammar(tools: list[dict] | None, tool_choice: object, grammar: Grammar | None,
                   grammar_field: str) -> Grammar | None:
    """The grammar an answer is held to: for tool_choice "required" or a named function, the
    grammar of `forced_call_schema` (the request's own grammar, given in `grammar_field`, is
    then refused); else the request's. InvalidRequest naming the field: a grammar beside a
    forced call, or tools whose parameters are a schema the grammar engine refuses."""
    schema = forced_call_schema(tools, tool_choice) if tools else None
    if schema is None:
        return grammar
    if grammar is not None:
        raise InvalidRequest(f"{grammar_field}: cannot be combined with tool_choice required or "
                             "a named function (the answer is a tool call)")
    try:
        return Grammar("json_schema", json.dumps(schema))
    except InvalidRequest as exc:
        detail = str(exc).removeprefix(FIELDS["json_schema"] + ": ")
        raise InvalidRequest(f"tools: the parameters are not a JSON schema this server can "
                             f"hold a call to ({detail})") from None


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it (a string)
    id: str

    def message(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# A block's call in its canonical order, up to where its arguments object opens: while
# streaming, the name is sent as soon as this much is seen, then the arguments as they come.
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
# What may still close the block: the arguments' and the call's braces (held back until more
# text shows they were the arguments' own).
_CLOSING = re.compile(r'(?:\s*\}){0,2}\s*$')


def _raw_arguments(body: str) -> str | None:
    """The arguments object's own text in a canonical call (`HEADER`, then the object, then
    the call's closing brace), or None. The arguments are sent as the model wrote them, so a
    streamed call's fragments add up to the arguments of the same answer parsed whole."""
    match = HEADER.match(body)
    if match is None:
        return None
    rest = body[match.end():].rstrip()
    return rest[:-1].rstrip() if rest.endswith("}") else None


def _parse_call(body: str) -> ToolCall | None:
    """A call from the JSON between the tags, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    raw = _raw_arguments(body)
    text = raw if raw is not None and _loads(raw) == arguments else json.dumps(
        arguments, ensure_ascii=False)
    return ToolCall(value["name"], text, _call_id())


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call_id() -> str:
    return "call_" + os.urandom(12).hex()


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back while streaming)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass
class _OpenCall:
    """A block whose call is being streamed: its name is sent; its arguments start at `start`
    of the pending text, of which `sent` characters are sent."""

    call: ToolCall
    start: int
    sent: int = 0


class ToolCallParser:
    """One answer's tool calls. `parse_whole` for a whole answer; `feed` for a stream, which
    returns the chat `delta`s to send: content outside the blocks, and for each call a delta
    with its index, id and name, then its arguments in fragments as the model writes them
    (OpenAI's order). A block not in the canonical order ({"name", "arguments"}) is sent whole
    once it closes."""

    def __init__(self, prefix: str = "", names: tuple[str, ...] = ()) -> None:
        """`prefix`: the answer's forced start (forced_prefix); `names`: the request's tools,
        which a bare call object must name."""
        self.prefix, self.names = prefix, names
        self.calls: list[ToolCall] = []
        self._pending = prefix  # text not yet sent
        self._inside = False
        self._open: _OpenCall | None = None
        self._sent_content = False

    def _bare_call(self, text: str) -> ToolCall | None:
        body = text.strip()
        if not body.startswith("{"):
            return None
        call = _parse_call(body)
        return call if call is not None and call.name in self.names else None

    def parse_whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content, or None when only calls were made; the calls)."""
        text = self.prefix + text
        bare = self._bare_call(text)
        if bare is not None:
            self.calls = [bare]
            return None, self.calls
        content, calls, position = [], [], 0
        while True:
            start = text.find(OPEN, position)
            if start < 0:
                content.append(text[position:])
                break
            content.append(text[position:start])
            end = text.find(CLOSE, start)
            body = text[start + len(OPEN): end if end >= 0 else len(text)]
            call = _parse_call(body.strip())
            if call is None:  # not a call: the model's text as it is
                content.append(text[start: end + len(CLOSE) if end >= 0 else len(text)])
            else:
                calls.append(call)
            if end < 0:
                break
            position = end + len(CLOSE)
        self.calls = calls
        joined = "".join(content).strip() if calls else "".join(content)
        return (joined or None) if calls else joined, calls

    def _content(self, deltas: list[dict], text: str) -> None:
        if text and not (self.calls and not text.strip()):
            deltas.append({"content": text})
            self._sent_content = True

    def feed(self, text: str, final: bool) -> list[dict]:
        self._pending += text
        deltas: list[dict] = []
        if not (self._sent_content or self.calls or self._inside) and \
                self._pending.lstrip().startswith("{"):
            if not final:
                return deltas  # perhaps a bare call: known at the end
            call = self._bare_call(self._pending)
            if call is not None:
                self._pending = ""
                self.calls.append(call)
                return self._call_deltas(0, call)
        while True:
            if not self._inside:
                start = self._pending.find(OPEN)
                if start < 0:
                    keep = 0 if final else _partial_tag(self._pending, OPEN)
                    head = self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(head):]
                    self._content(deltas, head)
                    return deltas
                self._content(deltas, self._pending[:start])
                self._pending = self._pending[start:]
                self._inside = True
            end = self._pending.find(CLOSE)
            if self._open is None:
                match = HEADER.match(self._pending, len(OPEN))
                name = _loads(match.group(1)) if match else None
                if isinstance(name, str):
                    self._open = _OpenCall(ToolCall(name, "", _call_id()), match.end())
                    deltas.append(self._call_deltas(len(self.calls), self._open.call)[0])
            if self._open is not None:
                deltas += self._stream_arguments(end, final)
            if end < 0 and not final:
                return deltas
            block = self._pending[: end + len(CLOSE)] if end >= 0 else self._pending
            self._pending = self._pending[len(block):]
            self._inside = False
            if self._open is not None:
                # Announced; a call only if its arguments are an object. One cut off by
                # max_tokens streamed as far as it got, as OpenAI's and vLLM's streams do, and
                # the answer's calls (the whole response, gRPC's) leave it out, as a whole
                # answer's parse does.
                if isinstance(_loads(self._open.call.arguments), dict):
                    self.calls.append(self._open.call)
                self._open = None
            else:
                body = block[len(OPEN): len(block) - len(CLOSE) if end >= 0 else len(block)]
                call = _parse_call(body.strip())
                if call is None:
                    deltas.append({"content": block})
                else:
                    self.calls.append(call)
                    deltas += self._call_deltas(len(self.calls) - 1, call)
            if final and not self._pending:
                return deltas

    def _stream_arguments(self, end: int, final: bool) -> list[dict]:
        """The open call's arguments not yet sent: all of them once its block ends (`end`: the
        close tag's position, or -1), else up to what may still be the closing braces."""
        call, region = self._open.call, self._pending[self._open.start: end if end >= 0
                                                     else len(self._pending)]
        if end >= 0 or final:
            region = region.rstrip()
            ready = region[:-1].rstrip() if region.endswith("}") else region
            call.arguments = ready
        else:
            region = region[: len(region) - _partial_tag(region, CLOSE)]
            ready = region[: _CLOSING.search(region).start()]
        piece = ready[self._open.sent:]
        self._open.sent = max(self._open.sent, len(ready))
        if not piece:
            return []
        return [{"tool_calls": [{"index": len(self.calls), "function": {"arguments": piece}}]}]

    @staticmethod
    def _call_deltas(index: int, call: ToolCall) -> list[dict]:
        """A call as OpenAI streams it: its index, id and name, then its arguments."""
        return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
