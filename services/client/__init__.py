"""sssd.client: the Python client of the Generate API (proto/sssd/v1/generate.proto), sync and
asyncio.

    with GenerationClient("127.0.0.1:50061") as client:
        for chunk in client.stream("Why is the sky blue?", max_tokens=64):
            print(chunk.text, end="", flush=True)
        result = client.generate("Name three primes.")  # the whole answer at once

A call that fails with UNAVAILABLE before the first answer message (server starting, draining,
restarting) is retried with exponential backoff; once tokens have arrived a failure is raised,
never retried, so an answer is never duplicated.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from sssd.common.rpc import tls
from sssd.common.rpc.api_key import KEY_ENV, call_metadata
from sssd.common.rpc.totals import Totals
from sssd.v1 import generate_pb2, generate_pb2_grpc

SPECULATION = {"auto": generate_pb2.SPECULATION_MODE_AUTO,
               "off": generate_pb2.SPECULATION_MODE_OFF,
               "sssd": generate_pb2.SPECULATION_MODE_SSSD,
               "ssd": generate_pb2.SPECULATION_MODE_SSD}

Prompt = str | Sequence[dict[str, str]] | Sequence[int]


class TokenLogprob(NamedTuple):
    """An emitted token's log-probability under the target model, and its top alternatives
    (most likely first; as many as the request's top_logprobs), with their texts."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    token: str = ""
    top_tokens: tuple[str, ...] = ()


class ToolCall(NamedTuple):
    """A call the model made (GenerateResponse.tool_calls): `arguments` is a JSON object's
    text, as OpenAI's API carries it."""

    id: str
    name: str
    arguments: str

    def message(self) -> dict:
        """The call as an assistant message's `tool_calls` entry (OpenAI's shape)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Chunk:
    """One streamed message: a text delta, its token ids and the step's statistics."""

    text: str
    token_ids: list[int]
    accepted_tokens: int | None  # draft tokens accepted in the step (None: prefill token)
    budget: int | None
    draft_ms: float | None
    verify_ms: float | None
    totals: Totals | None  # only on the last chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if asked
    tool_calls: list[ToolCall] = field(default_factory=list)  # on the last chunk, with tools


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    totals: Totals | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.tool_calls += chunk.tool_calls
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.totals = chunk.totals or self.totals


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 5  # including the first
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def delays(self) -> Iterator[float]:
        backoff = self.initial_backoff_s
        for _ in range(self.attempts - 1):
            yield backoff * (0.5 + random.random() / 2)  # jitter: retries do not synchronize
            backoff = min(self.max_backoff_s, backoff * 2)


def build_request(prompt: Prompt, max_tokens: int = 0, temperature: float = 0.0,
                  top_p: float | None = None, top_k: int = 0, seed: int | None = None,
                  stop: Sequence[str] = (), speculation: str = "auto",
                  top_logprobs: int | None = None, presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, repetition_penalty: float | None = None,
                  logit_bias: dict[int, float] | None = None, min_p: float = 0.0,
                  stop_token_ids: Sequence[int] = (), min_tokens: int = 0,
                  grammar: dict[str, Any] | None = None, tools: Sequence[dict] = (),
                  tool_choice: str | dict = "") -> generate_pb2.GenerateRequest:
    """A text prompt, chat messages ({"role", "content"} dicts, in OpenAI's shape: an
    assistant's `tool_calls`, a "tool" message's `tool_call_id`) or token ids. The fields are
    the proto's (proto/sssd/v1/generate.proto); `top_logprobs` set asks for each token's
    log-probability and that many alternatives; `grammar` is one of {"json_object": True},
    {"json_schema": a schema (dict or JSON text)}, {"regex": ...}, {"lark": ...} or
    {"choice": [strings]}; `tools` are OpenAI's ({"type": "function", "function": {"name",
    "description", "parameters"}}) and `tool_choice` "auto", "none", "required", a tool's
    name or OpenAI's {"type": "function", "function": {"name": ...}}.

    Raises ValueError naming the field for what the message cannot carry (a negative count, a
    seed beyond 64 bits); the server checks every range it serves and answers INVALID_ARGUMENT.
    """
    if speculation not in SPECULATION:
        raise ValueError(f"speculation: must be one of {', '.join(SPECULATION)}, got "
                         f"{speculation!r}")
    for name, value, bits, meaning in (("max_tokens", max_tokens, 32, "0: the server's default"),
                                       ("top_k", top_k, 32, "0: off"),
                                       ("seed", seed, 64, "unset: a random seed")):
        if value is not None and not 0 <= value < 2 ** bits:
            raise ValueError(f"{name}: {value} is outside [0, {2 ** bits - 1}] ({meaning})")
    for name, value in (("top_logprobs", top_logprobs), ("min_tokens", min_tokens)):
        if value is not None and not 0 <= value < 2 ** 32:
            raise ValueError(f"{name}: {value} is outside [0, {2 ** 32 - 1}]")
    request = generate_pb2.GenerateRequest(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, stop=list(stop),
        speculation=SPECULATION[speculation], presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, min_p=min_p, stop_token_ids=list(stop_token_ids),
        min_tokens=min_tokens, logit_bias=dict(logit_bias or {}))
    if top_logprobs is not None:
        request.top_logprobs = top_logprobs
    if grammar is not None:
        request.grammar.CopyFrom(grammar_message(grammar))
    if repetition_penalty is not None:
        request.repetition_penalty = repetition_penalty
    request.tools.extend(tool_message(tool) for tool in tools)
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice.get("function", {}).get("name", "")
    request.tool_choice = tool_choice
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and all(isinstance(item, dict) for item in prompt):
        request.chat.messages.extend(chat_message(m) for m in prompt)
    elif all(isinstance(item, int) for item in prompt):
        request.tokens.token_ids.extend(prompt)
    else:
        raise TypeError("prompt must be a string, a list of chat messages or a list of token ids")
    if top_p is not None:
        request.top_p = top_p
    if seed is not None:
        request.seed = seed
    return request


def tool_message(tool: dict) -> generate_pb2.Tool:
    """The proto Tool of an OpenAI tool (or of its bare "function" object)."""
    function = tool.get("function", tool)
    return generate_pb2.Tool(name=function["name"], description=function.get("description", ""),
                             parameters_json=json.dumps(function.get("parameters", {})))


def chat_message(message: dict) -> generate_pb2.ChatMessage:
    """The proto ChatMessage of an OpenAI chat message (text content)."""
    calls = [generate_pb2.ToolCall(id=call.get("id", ""), name=call["function"]["name"],
                                   arguments_json=call["function"]["arguments"])
             for call in message.get("tool_calls") or ()]
    return generate_pb2.ChatMessage(role=message["role"], content=message.get("content") or "",
                                    tool_calls=calls,
                                    tool_call_id=message.get("tool_call_id", ""))


def grammar_message(grammar: dict[str, Any]) -> generate_pb2.Grammar:
    """The proto Grammar of build_request's `grammar` (ValueError for another shape)."""
    kinds = ("json_object", "json_schema", "regex", "lark", "choice")
    if not isinstance(grammar, dict) or len(grammar) != 1 or next(iter(grammar)) not in kinds:
        raise ValueError(f"grammar: one of {', '.join(kinds)} as the only key, got {grammar!r}")
    (kind, value), = grammar.items()
    if kind == "json_object":
        return generate_pb2.Grammar(json_object=True)
    if kind == "choice":
        return generate_pb2.Grammar(choice=generate_pb2.Choices(choices=list(value)))
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    return generate_pb2.Grammar(**{kind: value})


def to_chunk(message: generate_pb2.GenerateResponse) -> Chunk:
    step = message.step if message.HasField("step") else None
    totals = None
    if message.HasField("totals"):
        t = message.totals
        totals = Totals(t.prompt_tokens, t.completion_tokens, t.time_to_first_token_s,
                        t.total_s, t.tokens_per_second, t.mean_accepted_length, t.finish_reason,
                        t.cached_tokens)
    logprobs = [TokenLogprob(e.token_id, e.logprob, tuple(zip(e.top_token_ids, e.top_logprobs)),
                             e.token, tuple(e.top_tokens)) for e in message.logprobs]
    return Chunk(message.text, list(message.token_ids),
                 step.accepted_tokens if step else None, step.budget if step else None,
                 step.draft_ms if step else None, step.verify_ms if step else None, totals,
                 logprobs, [ToolCall(c.id, c.name, c.arguments_json) for c in message.tool_calls])


def retry_delay(err: grpc.RpcError, received: bool, delays: Iterator[float]) -> float | None:
    """Seconds to wait before calling again, or None to raise `err`: only UNAVAILABLE before
    the first answer message is retried, so an answer is never duplicated."""
    if received or err.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    return next(delays, None)


class GenerationClient:
    def __init__(self, target: str, retry: RetryPolicy = RetryPolicy(),
                 timeout_s: float | None = None, tls_files: tls.TlsFiles | None = None,
                 api_key: str | None = None) -> None:
        """`timeout_s`: deadline of each call (None: none). `tls_files`: TLS to the server
        (default: the SSSD_TLS_* variables, see sssd.common.rpc.tls; none set: plaintext).
        `api_key`: presented on every call (default: $SSSD_API_KEY; unset: none)."""
        self.target, self.retry, self.timeout_s = target, retry, timeout_s
        self._metadata = call_metadata(api_key or os.environ.get(KEY_ENV))
        self._channel = tls.channel(target, tls_files)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)

    def stream(self, prompt: Prompt, **options) -> Iterator[Chunk]:
        """Yields the answer chunk by chunk; see `build_request` for the options."""
        request = build_request(prompt, **options)
        delays = self.retry.delays()
        while True:
            call = self._stub.Generate(request, timeout=self.timeout_s,
                                       metadata=self._metadata)
            received = False
            try:
                for message in call:
                    received = True
                    yield to_chunk(message)
                return
            except grpc.RpcError as err:
                delay = retry_delay(err, received, delays)
                if delay is None:
                    raise
                time.sleep(delay)
            finally:
                call.cancel()  # a consumer that stops early frees the sequence on the server

    def generate(self, prompt: Prompt, **options) -> Result:
        """The whole answer."""
        result = Result()
        for chunk in self.stream(prompt, **options):
            result.add(chunk)
        return result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncGenerationClient:
    def __init__(self, target: str, retry: RetryPolicy = RetryPolicy(),
                 timeout_s: float | None = None, tls_files: tls.TlsFiles | None = None,
                 api_key: str | None = None) -> None:
        self.target, self.retry, self.timeout_s = target, retry, timeout_s
        self._metadata = call_metadata(api_key or os.environ.get(KEY_ENV))
        self._channel = tls.aio_channel(target, tls_files)
        self._stub = generate_pb2_grpc.GenerationStub(self._channel)

    async def stream(self, prompt: Prompt, **options) -> AsyncIterator[Chunk]:
        request = build_request(prompt, **options)
        delays = self.retry.delays()
        while True:
            call = self._stub.Generate(request, timeout=self.timeout_s,
                                       metadata=self._metadata)
            received = False
            try:
                async for message in call:
                    received = True
                    yield to_chunk(message)
                return
            except grpc.RpcError as err:
                delay = retry_delay(err, received, delays)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
            finally:
                call.cancel()

    async def generate(self, prompt: Prompt, **options) -> Result:
        result = Result()
        async for chunk in self.stream(prompt, **options):
            result.add(chunk)
        return result

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncGenerationClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
