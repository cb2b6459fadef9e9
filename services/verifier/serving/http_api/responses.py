"""The HTTP API's replies as OpenAI shapes them: a whole completion, or the chunks of a stream
(a chat stream opens with the assistant's role; the last chunk of each choice carries its
finish reason and the `speculation` extension; with `stream_options.include_usage` a final chunk
with empty `choices` carries the usage), framed as server-sent events. A request of n choices
runs n requests in the engine; each is one `Choice` here, and the chunks of a stream carry
their choice's index."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from sssd.verifier.engine.token_logprob import TokenLogprob
from sssd.verifier.serving.backend import StreamEvent
from sssd.verifier.serving.http_api.schema import ParsedRequest
from sssd.verifier.serving.http_api.tool_calls import ToolCallParser


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class Choice:
    """One answer of a request, built from its events."""

    def __init__(self, index: int, chat: bool, token_text: Callable[[int], str],
                 tools: ToolCallParser | None = None) -> None:
        self.index, self.chat, self.token_text, self.tools = index, chat, token_text, tools
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.num_tokens = self.num_steps = self.num_accepted = 0
        self.num_cached_tokens: int | None = None  # known from the first event with tokens
        self.totals = None

    def add(self, event: StreamEvent) -> None:
        self.text.append(event.text)
        self.num_tokens += len(event.token_ids)
        if event.logprobs:
            self.logprobs.extend(event.logprobs)
        if event.num_cached_tokens is not None:
            self.num_cached_tokens = event.num_cached_tokens
        if event.step is not None:
            self.num_steps += 1
            self.num_accepted += event.step.accepted_tokens
        if event.totals is not None:
            self.totals = event.totals

    @property
    def finish_reason(self) -> str:
        reason = self.totals.finish_reason
        if self.tools is not None and self.tools.calls and reason == "stop":
            return "tool_calls"
        return reason

    def logprobs_json(self, entries: list[TokenLogprob], offset: int = 0) -> dict | None:
        """OpenAI's logprobs object of these tokens (chat: `content`; completions: parallel
        lists), starting at character `offset` of the text."""
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return item(entry.token_id, entry.logprob) | {
            "top_logprobs": [item(t, lp) for t, lp in entry.top]}

    def whole(self, wants_logprobs: bool) -> dict:
        text = "".join(self.text)
        choice = {"index": self.index, "finish_reason": None,
                  "logprobs": self.logprobs_json(self.logprobs) if wants_logprobs else None}
        if not self.chat:
            choice["text"] = text
        elif self.tools is not None:
            content, calls = self.tools.parse_whole(text)
            choice["message"] = {"role": "assistant", "content": content,
                                 "tool_calls": [call.message() for call in calls]}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice["finish_reason"] = self.finish_reason  # tool_calls once they are parsed
        return choice


class Answer:
    """The reply of one request, built from the events of its choices: whole, or as stream
    chunks."""

    def __init__(self, chat: bool, model: str, parsed: ParsedRequest, num_prompt_tokens: int,
                 token_text: Callable[[int], str],
                 tools: Callable[[], ToolCallParser] | None = None) -> None:
        self.chat, self.model, self.parsed = chat, model, parsed
        self.id = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.num_prompt_tokens = num_prompt_tokens
        self.choices = [Choice(index, chat, token_text, tools() if tools else None)
                        for index in range(parsed.n)]
        self.wants_logprobs = parsed.request.sampling.logprobs is not None
        self._num_text_chars = [0] * parsed.n  # completions' text_offset so far, per choice

    def add(self, index: int, event: StreamEvent) -> None:
        self.choices[index].add(event)

    def usage(self) -> dict:
        num_tokens = sum(c.num_tokens for c in self.choices)
        usage = {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": num_tokens,
                 "total_tokens": self.num_prompt_tokens + num_tokens}
        cached = [c.num_cached_tokens for c in self.choices if c.num_cached_tokens is not None]
        if cached:  # OpenAI's field: prompt tokens not recomputed (the first choice's)
            usage["prompt_tokens_details"] = {"cached_tokens": cached[0]}
        return usage

    def speculation(self) -> dict:
        steps = sum(c.num_steps for c in self.choices)
        accepted = sum(c.num_accepted for c in self.choices)
        return {"mode": self.parsed.mode, "verification_steps": steps,
                "accepted_draft_tokens": accepted,
                "tokens_per_step": round((accepted + steps) / steps, 4) if steps else 0.0}

    def whole(self) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model,
                "choices": [c.whole(self.wants_logprobs) for c in self.choices],
                "usage": self.usage(), "speculation": self.speculation()}

    def _chunk(self, index: int, delta: dict | None, text: str, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
        choice = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta if delta is not None else {"content": text}
        else:
            choice["text"] = text
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat
                 else "text_completion", "created": self.created, "model": self.model,
                 "choices": [choice]}
        if self.parsed.continuous_usage:
            chunk["usage"] = self.usage()
        elif self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self) -> list[dict]:
        """Chat streams open with the assistant's role, as OpenAI's do (once per choice)."""
        if not self.chat:
            return []
        return [self._chunk(c.index, {"role": "assistant", "content": ""}, "", None)
                for c in self.choices]

    def chunks(self, index: int, event: StreamEvent) -> list[dict]:
        choice = self.choices[index]
        choice.add(event)
        chunks = []
        logprobs = None
        if self.wants_logprobs and event.logprobs:
            logprobs = choice.logprobs_json(event.logprobs, self._num_text_chars[index])
            self._num_text_chars[index] += sum(len(choice.token_text(e.token_id))
                                               for e in event.logprobs)
        if choice.tools is not None:
            deltas = choice.tools.feed(event.text, final=event.totals is not None)
            for position, delta in enumerate(deltas):
                chunks.append(self._chunk(index, delta, "", None,
                                          logprobs if position == 0 else None))
            if not deltas and logprobs is not None:
                chunks.append(self._chunk(index, {}, "", None, logprobs))
        elif event.token_ids or event.text:
            chunks.append(self._chunk(index, None, event.text, None, logprobs))
        if event.totals is not None:
            last = self._chunk(index, {} if self.chat else None, "", choice.finish_reason)
            last["speculation"] = self.speculation()
            chunks.append(last)
        return chunks

    def closing(self) -> list[dict]:
        """After every choice ended: the usage chunk, where asked for."""
        if not self.parsed.include_usage:
            return []
        return [{"id": self.id, "object": "chat.completion.chunk" if self.chat
                 else "text_completion", "created": self.created, "model": self.model,
                 "choices": [], "usage": self.usage()}]


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs when the response ends for any reason (the client
    disconnected included: Starlette then cancels the stream)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
