"""The HTTP API's replies as OpenAI shapes them: a whole completion, or the chunks of a stream
(a chat stream opens with the assistant's role; the last chunk carries the finish reason and
the `speculation` extension; with `stream_options.include_usage` a final chunk with empty
`choices` carries the usage), framed as server-sent events."""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from sssd.verifier.serving.backend import RequestHandle, StreamEvent
from sssd.verifier.serving.http_api.schema import ParsedRequest


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class Answer:
    """The reply of one request, built from its events: whole, or as stream chunks."""

    def __init__(self, chat: bool, model: str, parsed: ParsedRequest,
                 handle: RequestHandle) -> None:
        self.chat, self.model, self.parsed = chat, model, parsed
        self.id = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.num_prompt_tokens = handle.num_prompt_tokens
        self.text: list[str] = []
        self.num_tokens = 0
        self.num_steps = 0
        self.num_accepted = 0
        self.num_cached_tokens: int | None = None  # known from the first event with tokens
        self.totals = None

    def add(self, event: StreamEvent) -> None:
        self.text.append(event.text)
        self.num_tokens += len(event.token_ids)
        if event.num_cached_tokens is not None:
            self.num_cached_tokens = event.num_cached_tokens
        if event.step is not None:
            self.num_steps += 1
            self.num_accepted += event.step.accepted_tokens
        if event.totals is not None:
            self.totals = event.totals

    def usage(self) -> dict:
        usage = {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                 "total_tokens": self.num_prompt_tokens + self.num_tokens}
        if self.num_cached_tokens is not None:  # OpenAI's field: prompt tokens not recomputed
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    def speculation(self) -> dict:
        return {"mode": self.parsed.mode, "verification_steps": self.num_steps,
                "accepted_draft_tokens": self.num_accepted,
                "tokens_per_step": round((self.num_accepted + self.num_steps) / self.num_steps,
                                         4) if self.num_steps else 0.0}

    def whole(self) -> dict:
        text = "".join(self.text)
        choice = {"index": 0, "finish_reason": self.totals.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [choice], "usage": self.usage(),
                "speculation": self.speculation()}

    def _chunk(self, delta: dict | None, text: str, finish_reason: str | None) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
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
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return [self._chunk({"role": "assistant", "content": ""}, "", None)] if self.chat else []

    def chunks(self, event: StreamEvent) -> list[dict]:
        self.add(event)
        chunks = []
        if event.token_ids or event.text:
            chunks.append(self._chunk(None, event.text, None))
        if event.totals is not None:
            last = self._chunk({} if self.chat else None, "", event.totals.finish_reason)
            last["speculation"] = self.speculation()
            chunks.append(last)
            if self.parsed.include_usage:
                chunks.append({"id": self.id, "object": chunks[-1]["object"],
                               "created": self.created, "model": self.model, "choices": [],
                               "usage": self.usage()})
        return chunks


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
