"""The OpenAI-compatible HTTP API, beside the gRPC API in the frontend process, on the same
backend (the engine in this process, or the Ray workers).

    POST /v1/chat/completions   messages -> the model's chat template -> an answer
    POST /v1/completions        a prompt (text or token ids), no template
    GET  /v1/models             the served model
    GET  /health                200 serving; 503 while loading or draining
    GET  /metrics               Prometheus text: sssd_api_* and vLLM's vllm:* names (api_metrics)
    POST /tokenize, /detokenize as vLLM's server has them

Streaming is server-sent events framed as OpenAI frames them: `data: {json}` lines and a last
`data: [DONE]`; with `stream_options.include_usage` a final chunk with empty `choices` carries
the usage. A field the engine cannot honour (logprobs, penalties other than their neutral value,
tools, response_format, n > 1) and a field nobody defined are answered 400 naming the field,
never ignored. Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
with the status from the same error-kind table as the gRPC API (STATUS_OF_KIND). A client that
disconnects cancels its request: its KV slot and drafter sequence are freed at once.

Extension: the request field `speculation` (auto, off, sssd, ssd, as in the gRPC API) and the
reply's `speculation` object (verification steps, accepted draft tokens, tokens per step).

Starlette on uvicorn, run on a thread of its own with its own event loop; the backend's event
queues are read on a thread pool (one blocking read per live request, as the gRPC API does).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import queue
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sssd.common.data.corpus import conversation_token_ids
from sssd.common.rpc.tls import TlsFiles
from sssd.verifier.engine.request import GenerateRequest, InvalidRequest, SamplingParams
from sssd.verifier.serving.api_metrics import CONTENT_TYPE, ApiMetrics, RequestTracker
from sssd.verifier.serving.backend import Backend, RequestHandle, StreamEvent
from sssd.verifier.serving.errors import ErrorKind, ServingError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413) unread
MAX_MESSAGES = 1024
SPECULATION_MODES = {"auto": (True, ""), "off": (False, ""), "sssd": (True, "sssd"),
                     "ssd": (True, "ssd")}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}

# The one place an error kind becomes an HTTP status (the gRPC API's table: frontend.py).
STATUS_OF_KIND = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.DRAINING: 503,
    ErrorKind.STOPPED: 503,
    ErrorKind.INTERNAL: 500,
}
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
               413: "invalid_request_error", 405: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

# Fields OpenAI defines that this engine cannot honour: accepted only at their neutral values.
_NONE, _FALSE, _ZERO, _ONE, _EMPTY = (None,), (None, False), (None, 0), (None, 1), (None, [], {})
NEUTRAL_ONLY = {
    "logprobs": _FALSE + (0,), "top_logprobs": _ZERO, "echo": _FALSE, "best_of": _ONE,
    "presence_penalty": _ZERO, "frequency_penalty": _ZERO, "repetition_penalty": _ONE,
    "logit_bias": _EMPTY, "suffix": (None, ""), "tools": _EMPTY, "functions": _EMPTY,
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
    "min_tokens": _ZERO, "min_p": _ZERO, "store": _FALSE, "service_tier": (None, "auto",
                                                                            "default"),
    "modalities": (None, ["text"]), "prediction": _NONE, "audio": _NONE,
    "reasoning_effort": _NONE, "web_search_options": _NONE, "include_stop_str_in_output": _FALSE,
    "skip_special_tokens": (None, True), "metadata": _EMPTY,
}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                 "ignore_eos", "stream", "stream_options", "user", "speculation"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _field_of(message: str, prompt_field: str) -> str | None:
    """The API field an InvalidRequest message starts with ("max_tokens: ..."), in this API's
    names (the engine says "prompt" for the token ids that the chat endpoint got as messages)."""
    name = message.split(":", 1)[0].strip()
    if not name or " " in name:
        return None
    return prompt_field if name in ("prompt", "resume") else name


@dataclass(frozen=True)
class ParsedRequest:
    request: GenerateRequest
    stream: bool
    include_usage: bool
    mode: str  # the speculation field
    continuous_usage: bool = False  # vLLM's extension: the usage so far in every chunk


class OpenAIApi:
    """The HTTP API's handlers; `attach` a backend and tokenizer to serve."""

    def __init__(self, model_name: str, max_model_len: int, max_tokens_limit: int,
                 default_max_tokens: int, max_workers: int,
                 metrics: ApiMetrics | None = None) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens
        self.metrics = metrics or ApiMetrics(model_name)
        self.backend: Backend | None = None
        self.tokenizer = None
        self.state = "loading"  # loading, serving, draining
        self.created = int(time.time())
        # Blocking reads of the backend's event queues, one per live request at a time.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers,
                                                           thread_name_prefix="http-events")
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.export_metrics, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed,
                               Exception: self._internal})

    def attach(self, backend: Backend, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.state = "serving"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- plain endpoints ----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "sssd-serve", "root": self.model_name, "parent": None,
            "max_model_len": self.max_model_len}]})

    async def health(self, request: Request) -> Response:
        if self.state == "serving":
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": self.state}, status_code=503)

    async def export_metrics(self, request: Request) -> Response:
        return Response(self.metrics.export(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            tokenizer = self._serving().tokenizer
            _refuse_unknown(body, {"model", "prompt", "messages", "add_special_tokens",
                                   "add_generation_prompt"})
            self._check_model(body)
            if ("prompt" in body) == ("messages" in body):
                raise ApiError(400, "set exactly one of prompt and messages", "prompt")
            if "prompt" in body:
                if not isinstance(body["prompt"], str):
                    raise ApiError(400, "prompt: must be a string", "prompt")
                special = _bool(body, "add_special_tokens", True)
                tokens = list(tokenizer.encode(body["prompt"], add_special_tokens=special))
            else:
                tokens = self._chat_ids(_messages(body["messages"]),
                                        _bool(body, "add_generation_prompt", True))
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"count": len(tokens), "max_model_len": self.max_model_len,
                             "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            tokenizer = self._serving().tokenizer
            _refuse_unknown(body, {"model", "tokens"})
            self._check_model(body)
            tokens = self._token_ids(body.get("tokens"))
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"prompt": tokenizer.decode(tokens)})

    # --- generation ---------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, http: Request, chat: bool) -> Response:
        prompt_field = "messages" if chat else "prompt"
        try:
            body = await self._body(http)
            backend = self._serving().backend
            # Tokenizing (a chat template, up to 4 MiB of text) off the event loop, so other
            # streams are not held up behind it.
            parsed = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._parse, body, chat)
            try:
                handle = backend.submit(parsed.request)
            except InvalidRequest as exc:
                raise ApiError(400, str(exc), _field_of(str(exc), prompt_field)) from None
            except ServingError as exc:
                self.metrics.refused_request(exc.kind.value)
                raise ApiError(STATUS_OF_KIND[exc.kind], str(exc), code=exc.kind.value) \
                    from None
        except ApiError as exc:
            return exc.response()
        tracker = self.metrics.track(handle.num_prompt_tokens)
        answer = _Answer(chat, self.model_name, parsed, handle)
        if parsed.stream:
            return EventStream(self._stream(handle, answer, tracker),
                               on_close=lambda: self._end(handle, tracker))
        watcher = asyncio.create_task(_watch_disconnect(
            http, lambda: self._end(handle, tracker)))
        try:
            error = None
            async for event in self._events(handle):
                tracker.event(event)
                answer.add(event)
                if event.error is not None:
                    error = event.error
            if error is not None:
                return ApiError(STATUS_OF_KIND[error.kind], error.message,
                                code=error.kind.value).response()
            return JSONResponse(answer.whole())
        finally:
            watcher.cancel()
            self._end(handle, tracker)

    async def _stream(self, handle: RequestHandle, answer: "_Answer",
                      tracker: RequestTracker) -> AsyncIterator[bytes]:
        for chunk in answer.opening():
            yield _sse(chunk)
        async for event in self._events(handle):
            tracker.event(event)
            if event.error is not None:
                error = ApiError(STATUS_OF_KIND[event.error.kind], event.error.message,
                                 code=event.error.kind.value)
                yield _sse(error.body())
                break
            for chunk in answer.chunks(event):
                yield _sse(chunk)
        yield b"data: [DONE]\n\n"

    async def _events(self, handle: RequestHandle) -> AsyncIterator[StreamEvent]:
        """The request's events until its last one."""
        loop = asyncio.get_running_loop()
        while True:
            event = await loop.run_in_executor(self._pool, _next_event, handle.events)
            if event is None:
                continue
            yield event
            if event.totals is not None or event.error is not None:
                return

    def _end(self, handle: RequestHandle, tracker: RequestTracker) -> None:
        """After the response, however it ended (the client gone included): frees the request
        if it still runs."""
        if not tracker.is_ended:
            tracker.end("abort")
        if self.backend is not None:
            self.backend.cancel(handle.request_id)  # a no-op once it finished

    # --- request parsing ----------------------------------------------------------------------

    async def _body(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body of {declared} bytes; the limit is "
                           f"{MAX_BODY_BYTES}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise ApiError(413, f"request body over the limit of {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "the client disconnected while sending the body") from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError):
            raise ApiError(400, "the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def _serving(self) -> "OpenAIApi":
        if self.state != "serving" or self.backend is None:
            state = "the model is still loading" if self.state == "loading" \
                else "the server is shutting down"
            raise ApiError(503, state, code=self.state)
        return self

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise ApiError(400, "model: must be a string", "model")
        if model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist: this server serves "
                           f"`{self.model_name}` (GET /v1/models)", "model", "model_not_found")

    def _parse(self, body: dict, chat: bool) -> ParsedRequest:
        _refuse_unknown(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        self._check_model(body)
        if chat:
            if "messages" not in body:
                raise ApiError(400, "messages: required", "messages")
            prompt_ids = self._chat_ids(_messages(body["messages"]), True)
        else:
            if "prompt" not in body:
                raise ApiError(400, "prompt: required", "prompt")
            prompt_ids = self._prompt_ids(body["prompt"])
        max_tokens = self._max_tokens(body, chat)
        n = body.get("n")
        if n is not None and n != 1:
            raise ApiError(400, f"n: only 1 choice per request is supported, got {n!r}", "n")
        stream = _bool(body, "stream", False)
        include_usage = continuous_usage = False
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise ApiError(400, "stream_options: only allowed when stream is true",
                               "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage",
                                                                 "continuous_usage_stats"}:
                raise ApiError(400, "stream_options: an object with include_usage",
                               "stream_options")
            include_usage = _bool(options, "include_usage", False, "stream_options")
            continuous_usage = _bool(options, "continuous_usage_stats", False,
                                     "stream_options")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ApiError(400, "stop: a string or a list of strings", "stop")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise ApiError(400, "user: must be a string", "user")
        mode = body.get("speculation", "auto")
        if mode not in SPECULATION_MODES:
            raise ApiError(400, f"speculation: one of {', '.join(SPECULATION_MODES)}, got "
                           f"{mode!r}", "speculation")
        speculate, source = SPECULATION_MODES[mode]
        temperature = _number(body, "temperature", 1.0)
        top_k = body.get("top_k")
        if top_k is None or top_k == -1:  # vLLM's "off"
            top_k = 0
        seed = body.get("seed")
        try:
            sampling = SamplingParams(temperature=temperature, top_p=_number(body, "top_p", 1.0),
                                      top_k=top_k, seed=seed)
            request = GenerateRequest(tuple(prompt_ids), max_tokens, sampling, tuple(stop),
                                      speculate=speculate, source=source,
                                      ignore_eos=_bool(body, "ignore_eos", False))
        except InvalidRequest as exc:
            raise ApiError(400, str(exc), _field_of(str(exc), "messages" if chat
                                                    else "prompt")) from None
        return ParsedRequest(request, stream, include_usage, mode, continuous_usage)

    def _max_tokens(self, body: dict, chat: bool) -> int:
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        for name in names:
            value = body.get(name)
            if value is None:
                continue
            if not _is_int(value) or not 1 <= value <= self.max_tokens_limit:
                raise ApiError(400, f"{name}: an integer in [1, {self.max_tokens_limit}], got "
                               f"{value!r}", name)
            return value
        return self.default_max_tokens

    def _prompt_ids(self, prompt: object) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt: must not be empty", "prompt")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            return prompt  # the backend's RequestLimits checks them against the vocabulary
        if isinstance(prompt, list) and len(prompt) > 1 and all(
                isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, "prompt: one prompt per request (batches are not supported)",
                           "prompt")
        raise ApiError(400, "prompt: a non-empty string or a non-empty list of token ids",
                       "prompt")

    def _token_ids(self, tokens: object) -> list[int]:
        """/detokenize's `tokens`: ids of the tokenizer (no backend checks them there)."""
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise ApiError(400, "tokens: a list of token ids", "tokens")
        vocab = len(self.tokenizer)
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})",
                           "tokens")
        return tokens

    def _chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        try:
            return conversation_token_ids(self.tokenizer, messages,
                                          add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # the template refuses this conversation (e.g. role order)
            raise ApiError(400, f"messages: the model's chat template refused them ({exc})",
                           "messages") from None

    # --- error pages --------------------------------------------------------------------------

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}").response()

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def _internal(self, request: Request, exc: Exception) -> Response:
        logger.exception("HTTP %s %s failed", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}").response()


def _refuse_unknown(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL_ONLY:
            if value in NEUTRAL_ONLY[name]:
                continue
            raise ApiError(400, f"{name}: not supported by this server (only its neutral value "
                           f"is accepted), got {json.dumps(value)[:80]}", name, "unsupported")
        raise ApiError(400, f"Unrecognized request argument supplied: {name}", name)


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: must be true or false, got {json.dumps(value)[:40]}",
                       param or name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise ApiError(400, f"{name}: must be a number, got {json.dumps(value)[:40]}", name)
    return float(value)


def _messages(messages: object) -> list[dict[str, str]]:
    """OpenAI chat messages as {"role", "content"} with string content (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: a non-empty list of messages", "messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"messages: at most {MAX_MESSAGES}", "messages")
    result = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where}: must be an object", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"{where}.role: one of {', '.join(CHAT_ROLES)}, got "
                           f"{json.dumps(role)[:40]}", "messages")
        for name in message:
            if name not in ("role", "content", "name"):
                raise ApiError(400, f"{where}.{name}: not supported by this server",
                               "messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}):
                    raise ApiError(400, f"{where}.content[{part_index}]: only text parts "
                                   "({\"type\": \"text\", \"text\": ...}) are supported",
                                   "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content: a string or a list of text parts",
                           "messages")
        result.append({"role": CHAT_ROLES[role], "content": content})
    if not any(m["content"].strip() for m in result):
        raise ApiError(400, "messages: need at least one non-empty message", "messages")
    return result


def _next_event(events: queue.Queue) -> StreamEvent | None:
    try:
        return events.get(timeout=0.5)
    except queue.Empty:
        return None


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Waits for the client to go away (a non-streaming request), then calls `on_disconnect`."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class _Answer:
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
        self.totals = None

    def add(self, event: StreamEvent) -> None:
        self.text.append(event.text)
        self.num_tokens += len(event.token_ids)
        if event.step is not None:
            self.num_steps += 1
            self.num_accepted += event.step.accepted_tokens
        if event.totals is not None:
            self.totals = event.totals

    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_tokens}

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


class HttpServer:
    """uvicorn serving an OpenAIApi on a thread of its own; over TLS with the same files as the
    gRPC API (SSSD_TLS_CERT/KEY; with SSSD_TLS_CA clients must present a certificate)."""

    def __init__(self, api: OpenAIApi, host: str, port: int, tls: TlsFiles | None = None) -> None:
        self.api = api
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise RuntimeError(f"the HTTP API cannot bind {host}:{port} ({exc.strerror}): move "
                               "it with --http-port, or turn it off with --no-http") from None
        self._socket.listen(256)
        self.host = host
        self.port = self._socket.getsockname()[1]
        self.tls = tls if tls is not None and tls.serves_tls else None
        secure = {}
        if self.tls is not None:
            secure = {"ssl_certfile": self.tls.cert, "ssl_keyfile": self.tls.key}
            if self.tls.ca:
                secure |= {"ssl_ca_certs": self.tls.ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(api.app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1, access_log=False, **secure)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]},
                                        name="http-api", daemon=True)

    def start(self) -> "HttpServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the HTTP API did not start on {self.host}:{self.port}")
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
        self.api.close()
