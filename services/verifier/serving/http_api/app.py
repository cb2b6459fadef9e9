"""The HTTP API's endpoints on one backend: generation (whole or streamed), the model list,
health, metrics, tokenize and detokenize. A client that disconnects cancels its request: its KV
blocks and drafter sequence are freed at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sssd.common.model.tokenizer import TokenTexts
from sssd.common.rpc.api_key import ApiKey
from sssd.verifier.engine.request import InvalidRequest
from sssd.verifier.serving.api_metrics import CONTENT_TYPE, ApiMetrics, RequestTracker
from sssd.verifier.serving.backend import Backend, RequestHandle, StreamEvent
from sssd.verifier.serving.errors import ServingError
from sssd.verifier.serving.http_api.errors import ApiError
from sssd.verifier.serving.http_api.responses import Answer, EventStream, sse
from sssd.verifier.serving.http_api.schema import (
    MAX_BODY_BYTES,
    STATUS_OF_KIND,
    RequestParser,
    boolean,
    chat_messages,
    choice_requests,
    field_of,
    refuse_unknown,
)
from sssd.verifier.serving.http_api.tool_calls import ToolCallParser

logger = logging.getLogger(__name__)


class OpenAIApi:
    """The HTTP API's handlers; `attach` a backend and tokenizer to serve."""

    def __init__(self, model_name: str, max_tokens_limit: int | None,
                 default_max_tokens: int, max_workers: int,
                 metrics: ApiMetrics | None = None, api_key: str | None = None,
                 open_health: bool = True) -> None:
        """`api_key`: required as a bearer token on /v1/* and the tokenize endpoints (and on
        /health and /metrics unless `open_health`); None: every endpoint is open."""
        self.model_name = model_name
        self.api_key = ApiKey(api_key) if api_key else None
        self.open_paths = ("/health", "/metrics") if open_health else ()
        self.token_text: TokenTexts | None = None  # with the tokenizer, once attached
        self.max_model_len = 0  # the backend's context window, once attached
        self.max_tokens_limit = max_tokens_limit  # None: what the window holds
        self.default_max_tokens = default_max_tokens
        self.parser: RequestParser | None = None  # with the tokenizer, once attached
        self.metrics = metrics or ApiMetrics(model_name)
        self.backend: Backend | None = None
        self.state = "loading"  # loading, serving, draining
        self.created = int(time.time())
        # Blocking reads of the backend's event queues, one per live request at a time.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers,
                                                           thread_name_prefix="http-events")
        self.app = Starlette(middleware=[Middleware(_KeyCheck, api=self)], routes=[
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
        self.max_model_len = backend.limits.context_window
        limit = self.max_tokens_limit or max(1, self.max_model_len - 1)
        self.parser = RequestParser(self.model_name, tokenizer, limit,
                                    min(self.default_max_tokens, limit))
        self.token_text = TokenTexts(tokenizer)
        self.backend = backend
        self.metrics.gauges = backend.engine_gauges
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
        # Off the event loop: a Ray backend's gauges come from its workers.
        body = await asyncio.get_running_loop().run_in_executor(self._pool, self.metrics.export)
        return Response(body, media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            parser = self._serving().parser
            refuse_unknown(body, {"model", "prompt", "messages", "add_special_tokens",
                                  "add_generation_prompt"})
            parser.check_model(body)
            if ("prompt" in body) == ("messages" in body):
                raise ApiError(400, "set exactly one of prompt and messages", "prompt")
            if "prompt" in body:
                if not isinstance(body["prompt"], str):
                    raise ApiError(400, "prompt: must be a string", "prompt")
                special = boolean(body, "add_special_tokens", True)
                tokens = list(parser.tokenizer.encode(body["prompt"],
                                                      add_special_tokens=special))
            else:
                tokens = parser.chat_ids(chat_messages(body["messages"]),
                                         boolean(body, "add_generation_prompt", True))
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"count": len(tokens), "max_model_len": self.max_model_len,
                             "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            parser = self._serving().parser
            refuse_unknown(body, {"model", "tokens"})
            parser.check_model(body)
            tokens = parser.token_ids(body.get("tokens"))
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"prompt": parser.tokenizer.decode(tokens)})

    # --- generation ---------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, http: Request, chat: bool) -> Response:
        prompt_field = "messages" if chat else "prompt"
        handles: list[RequestHandle] = []
        backend = None
        try:
            body = await self._body(http)
            backend = self._serving().backend
            # Tokenizing (a chat template, up to 4 MiB of text) off the event loop, so other
            # streams are not held up behind it.
            parsed = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.parser.parse, body, chat)
            try:
                for request in choice_requests(parsed):
                    handles.append(backend.submit(request))
            except InvalidRequest as exc:
                raise ApiError(400, str(exc), field_of(str(exc), prompt_field)) from None
            except ServingError as exc:
                self.metrics.refused_request(exc.kind.value)
                raise ApiError(STATUS_OF_KIND[exc.kind], str(exc), code=exc.kind.value) \
                    from None
        except ApiError as exc:
            for handle in handles:  # the choices admitted before one was refused
                backend.cancel(handle.request_id)  # (backend is set where handles are)
            return exc.response()
        trackers = [self.metrics.track(handle.num_prompt_tokens) for handle in handles]
        tools = (lambda: ToolCallParser(parsed.tool_prefix, parsed.tool_names)) \
            if parsed.parses_tools else None
        answer = Answer(chat, self.model_name, parsed, handles[0].num_prompt_tokens,
                        self.token_text, tools)
        end = lambda: self._end(handles, trackers)  # noqa: E731 - run on every way out
        if parsed.stream:
            return EventStream(self._stream(handles, answer, trackers), on_close=end)
        watcher = asyncio.create_task(_watch_disconnect(http, end))
        try:
            async for index, event in self._merged(handles):
                trackers[index].event(event)
                if event.error is not None:
                    return ApiError(STATUS_OF_KIND[event.error.kind], event.error.message,
                                    code=event.error.kind.value).response()
                answer.add(index, event)
            return JSONResponse(answer.whole())
        finally:
            watcher.cancel()
            end()

    async def _stream(self, handles: list[RequestHandle], answer: Answer,
                      trackers: list[RequestTracker]) -> AsyncIterator[bytes]:
        for chunk in answer.opening():
            yield sse(chunk)
        async for index, event in self._merged(handles):
            trackers[index].event(event)
            if event.error is not None:
                error = ApiError(STATUS_OF_KIND[event.error.kind], event.error.message,
                                 code=event.error.kind.value)
                yield sse(error.body())
                break
            for chunk in answer.chunks(index, event):
                yield sse(chunk)
        else:
            for chunk in answer.closing():
                yield sse(chunk)
        yield b"data: [DONE]\n\n"

    async def _merged(self, handles: list[RequestHandle]
                      ) -> AsyncIterator[tuple[int, StreamEvent]]:
        """(choice index, event) of every choice as they come, until each one's last; stops
        after the first error (the other choices are then cancelled by `_end`)."""
        if len(handles) == 1:
            async for event in self._events(handles[0]):
                yield 0, event
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, handle: RequestHandle) -> None:
            async for event in self._events(handle):
                await merged.put((index, event))

        pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        try:
            num_open = len(handles)
            while num_open:
                index, event = await merged.get()
                yield index, event
                if event.error is not None:
                    return
                if event.totals is not None:
                    num_open -= 1
        finally:
            for task in pumps:
                task.cancel()

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

    def _end(self, handles: list[RequestHandle], trackers: list[RequestTracker]) -> None:
        """After the response, however it ended (the client gone included): frees the
        requests of its choices that still run."""
        for handle, tracker in zip(handles, trackers):
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

    # --- error pages --------------------------------------------------------------------------

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}").response()

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def _internal(self, request: Request, exc: Exception) -> Response:
        logger.exception("HTTP %s %s failed", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}").response()


class _KeyCheck:
    """ASGI middleware: a request without the API key gets OpenAI's 401 before any handler
    (or body read) runs. Unknown paths are checked too, so routes do not leak without it."""

    def __init__(self, app, api: OpenAIApi) -> None:
        self.app, self.api = app, api

    async def __call__(self, scope, receive, send) -> None:
        key = self.api.api_key
        if scope["type"] != "http" or key is None or scope["path"] in self.api.open_paths:
            return await self.app(scope, receive, send)
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        if key.matches(authorization):
            return await self.app(scope, receive, send)
        self.api.metrics.refused_request("unauthenticated")
        response = ApiError(401, "Incorrect API key provided: send it as `Authorization: "
                            "Bearer <key>` (the server's --api-key)",
                            code="invalid_api_key").response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def _next_event(events: queue.Queue) -> StreamEvent | None:
    try:
        return events.get(timeout=0.5)
    except queue.Empty:
        return None


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Waits for the client to go away (a non-streaming request), then calls `on_disconnect`."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return
