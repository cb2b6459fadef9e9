"""The public gRPC API (proto/sssd/v1/generate.proto) in front of a serving backend.

The servicer turns each request message into a `GenerateRequest` (every bad field is
INVALID_ARGUMENT naming the field and its allowed range), submits it to the backend (the
single-process `EngineLoop`, or `RayBackend` with prefill/decode workers) and streams the
backend's events back. Refusals and failures carry an `ErrorKind`, mapped to a status code in
one table. The RPC's termination callback cancels the request, so a client cancel or an
expired deadline frees the sequence at once.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sssd.common.data.corpus import conversation_token_ids
from sssd.common.model.files import resolve_model
from sssd.common.model.loader import load_causal_lm
from sssd.common.model.threads import off_main_thread
from sssd.common.model.tokenizer import TokenTexts, load_tokenizer
from sssd.common.rpc import tls
from sssd.common.rpc.api_key import ApiKey, ApiKeyInterceptor
from sssd.common.rpc.targets import address
from sssd.v1 import generate_pb2, generate_pb2_grpc
from sssd.verifier.engine.request import GenerateRequest, Grammar, InvalidRequest, SamplingParams
from sssd.verifier.serving.api_metrics import ApiMetrics
from sssd.verifier.serving.backend import Backend, StreamEvent
from sssd.verifier.serving.config import FrontendConfig
from sssd.verifier.serving.errors import ErrorKind, ServingError
from sssd.verifier.serving.http_api import HttpServer, OpenAIApi
from sssd.verifier.serving.http_api.errors import ApiError
from sssd.verifier.serving.http_api.schema import RequestParser, chat_messages
from sssd.verifier.serving.http_api.tool_calls import (
    ToolCallParser,
    answer_grammar,
    forced_prefix,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# The API's speculation mode -> the engine's drafting source ("" = the server's choice).
SOURCE_OF_MODE = {generate_pb2.SPECULATION_MODE_AUTO: "",
                  generate_pb2.SPECULATION_MODE_SSSD: "sssd",
                  generate_pb2.SPECULATION_MODE_SSD: "ssd"}

# The one place an error kind becomes a gRPC status.
STATUS_OF_KIND = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DRAINING: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.STOPPED: grpc.StatusCode.CANCELLED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, config: FrontendConfig, metrics: ApiMetrics) -> None:
        self.config = config
        self.metrics = metrics  # shared with the HTTP API: its GET /metrics covers both
        self.backend: Backend | None = None  # set once the model is loaded
        self.tokenizer = None
        self.token_text: TokenTexts | None = None  # with the tokenizer

    def attach(self, backend: Backend, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenTexts(tokenizer)
        self.backend = backend

    def Generate(self, request: generate_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[generate_pb2.GenerateResponse]:
        backend = self.backend
        if backend is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        try:
            engine_request, tool_parser = self.parse(request)
            handle = backend.submit(engine_request)
        except InvalidRequest as exc:
            context.abort(STATUS_OF_KIND[ErrorKind.INVALID_ARGUMENT], str(exc))
        except ServingError as exc:
            self.metrics.refused_request(exc.kind.value)
            context.abort(STATUS_OF_KIND[exc.kind], str(exc))
        tracker = self.metrics.track(handle.num_prompt_tokens)
        # Runs as soon as the RPC ends for any reason (client cancel, deadline, normal end),
        # even while this thread waits for the next event; the finally covers the rest.
        context.add_callback(lambda: backend.cancel(handle.request_id))
        try:
            while True:
                try:
                    event: StreamEvent = handle.events.get(timeout=1.0)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                tracker.event(event)
                if event.error is not None:
                    context.abort(STATUS_OF_KIND[event.error.kind], event.error.message)
                response = to_response(event, self.token_text)
                if tool_parser is not None:
                    with_tool_calls(response, tool_parser, event.totals is not None)
                yield response
                if event.totals is not None:
                    return
        finally:
            tracker.end("abort")  # a no-op once it ended
            backend.cancel(handle.request_id)  # a no-op once the request finished

    def parse(self, request: generate_pb2.GenerateRequest
              ) -> tuple[GenerateRequest, ToolCallParser | None]:
        """The request in engine terms and, where it offers tools, the parser of the answer's
        calls; InvalidRequest naming the field and its range. The model's limits (vocabulary,
        context window) are the backend's to check."""
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequest("prompt: set one of text, chat or tokens")
        tools, choice = self.tools(request, kind)
        prefix = forced_prefix(choice) if tools else ""
        if kind == "text":
            if not request.text.strip():
                raise InvalidRequest("prompt.text: must not be empty")
            prompt_ids = self.chat_ids([{"role": "user", "content": request.text}], tools)
        elif kind == "chat":
            prompt_ids = self.chat_ids(chat_of(request.chat.messages), tools)
        else:
            prompt_ids = list(request.tokens.token_ids)
            if not prompt_ids:
                raise InvalidRequest("prompt.tokens.token_ids: must not be empty")
        if prefix:  # the answer starts inside the call the choice forces
            prompt_ids += list(self.tokenizer.encode(prefix, add_special_tokens=False))
        limit = self.config.max_tokens_limit
        if limit is None:  # what the backend's context window holds beside the prompt
            window = self.backend.limits.context_window if self.backend is not None else 0
            limit = max(1, window - 1) if window else 1 << 30
        max_tokens = request.max_tokens or min(self.config.default_max_tokens, limit)
        if not 1 <= max_tokens <= limit:
            raise InvalidRequest(f"max_tokens: {max_tokens} is outside [1, {limit}] (0 = "
                                 f"default {self.config.default_max_tokens})")
        sampling = SamplingParams(
            temperature=float(request.temperature),
            top_p=float(request.top_p) if request.HasField("top_p") else 1.0,
            top_k=int(request.top_k), seed=request.seed if request.HasField("seed") else None,
            presence_penalty=float(request.presence_penalty),
            frequency_penalty=float(request.frequency_penalty),
            repetition_penalty=float(request.repetition_penalty)
            if request.HasField("repetition_penalty") else 1.0,
            logit_bias=tuple(sorted(request.logit_bias.items())), min_p=float(request.min_p),
            logprobs=request.top_logprobs if request.HasField("top_logprobs") else None)
        mode = request.speculation
        if mode != generate_pb2.SPECULATION_MODE_OFF and mode not in SOURCE_OF_MODE:
            raise InvalidRequest(f"speculation: unknown mode {mode}")
        engine_request = GenerateRequest(
            tuple(prompt_ids), max_tokens, sampling, tuple(request.stop),
            speculate=mode != generate_pb2.SPECULATION_MODE_OFF,
            source=SOURCE_OF_MODE.get(mode, ""), stop_token_ids=tuple(request.stop_token_ids),
            min_tokens=int(request.min_tokens),
            grammar=answer_grammar(tools, choice, grammar_of(request.grammar)
                                   if request.HasField("grammar") else None, "grammar"))
        if not tools:
            return engine_request, None
        return engine_request, ToolCallParser(prefix, tuple(t.name for t in request.tools))

    def tools(self, request: generate_pb2.GenerateRequest, kind: str
              ) -> tuple[list[dict] | None, object]:
        """The request's tools in OpenAI's shape, for the chat template (None: none, or
        tool_choice "none"), and its tool_choice as the HTTP API takes it."""
        choice: object = request.tool_choice or "auto"
        if not request.tools:
            if choice not in ("none", "auto"):
                raise InvalidRequest("tool_choice: needs tools")
            return None, "none"
        if kind == "tokens":
            raise InvalidRequest("tools: need a text or chat prompt (the chat template renders "
                                 "them; token ids are sent as they are)")
        tools = []
        for index, tool in enumerate(request.tools):
            if not tool.name:
                raise InvalidRequest(f"tools[{index}].name: required")
            try:
                parameters = json.loads(tool.parameters_json) if tool.parameters_json else {}
            except ValueError:
                parameters = None
            if not isinstance(parameters, dict):
                raise InvalidRequest(f"tools[{index}].parameters_json: a JSON schema (an "
                                     "object) as JSON text")
            tools.append({"type": "function", "function": {
                "name": tool.name, "description": tool.description, "parameters": parameters}})
        names = [tool.name for tool in request.tools]
        if choice not in ("none", "auto", "required"):
            if choice not in names:
                raise InvalidRequest(f"tool_choice: none, auto, required or one of the tools' "
                                     f"names, got {choice!r}")
            choice = {"type": "function", "function": {"name": choice}}
        parser = RequestParser(served_model_name(self.config), self.tokenizer, 1, 1)
        try:
            tools, choice = parser.tools({"tools": tools, "tool_choice": choice})
        except ApiError as exc:
            raise InvalidRequest(exc.message) from None
        return (tools if choice != "none" else None), choice

    def chat_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            return conversation_token_ids(self.tokenizer, messages, add_generation_prompt=True,
                                          tools=tools)
        except Exception as exc:  # the template refuses this conversation (e.g. role order)
            raise InvalidRequest(f"prompt.chat.messages: the model's chat template refused "
                                 f"them ({exc})") from None


def chat_of(messages) -> list[dict]:
    """ChatMessages as the chat template takes them, checked as the HTTP API checks its
    messages (InvalidRequest naming the message and field)."""
    converted = []
    for index, message in enumerate(messages):
        entry: dict = {"role": message.role, "content": message.content}
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments_json or "{}"}}
                for call in message.tool_calls]
        if message.tool_call_id or message.role == "tool":
            if not message.tool_call_id:
                raise InvalidRequest(f"prompt.chat.messages[{index}].tool_call_id: required (the "
                                     "id of the call this answers)")
            entry["tool_call_id"] = message.tool_call_id
        converted.append(entry)
    try:
        return chat_messages(converted)
    except ApiError as exc:
        raise InvalidRequest("prompt.chat." + exc.message) from None


def grammar_of(message: generate_pb2.Grammar) -> Grammar:
    """The engine's Grammar of a Generate request's (InvalidRequest when it is invalid)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("grammar: set one of json_object, json_schema, regex, lark, choice")
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "choice":
        return Grammar("choice", choices=tuple(message.choice.choices))
    return Grammar("grammar" if kind == "lark" else kind, getattr(message, kind))


def with_tool_calls(response: generate_pb2.GenerateResponse, parser: ToolCallParser,
                    final: bool) -> None:
    """The response's text without the answer's tool-call blocks (held back until a block is
    known to be one); the last response carries the parsed calls."""
    deltas = parser.feed(response.text, final)
    response.text = "".join(delta.get("content", "") for delta in deltas)
    if final and parser.calls:
        response.tool_calls.extend(generate_pb2.ToolCall(id=call.id, name=call.name,
                                                         arguments_json=call.arguments)
                                   for call in parser.calls)
        if response.totals.finish_reason == "stop":
            response.totals.finish_reason = "tool_calls"


def to_response(event: StreamEvent, token_text: Callable[[int], str]
                ) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids)
    for entry in event.logprobs or ():
        response.logprobs.add(token_id=entry.token_id, logprob=entry.logprob,
                              top_token_ids=[t for t, _ in entry.top],
                              top_logprobs=[lp for _, lp in entry.top],
                              token=token_text(entry.token_id),
                              top_tokens=[token_text(t) for t, _ in entry.top])
    if event.step is not None:
        response.step.CopyFrom(generate_pb2.StepStats(
            accepted_tokens=event.step.accepted_tokens, budget=event.step.budget,
            draft_ms=event.step.draft_ms, verify_ms=event.step.verify_ms))
    if event.totals is not None:
        t = event.totals
        response.totals.CopyFrom(generate_pb2.GenerateTotals(
            prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens,
            time_to_first_token_s=t.time_to_first_token_s, total_s=t.total_s,
            tokens_per_second=t.tokens_per_second, mean_accepted_length=t.mean_accepted_length,
            finish_reason=t.finish_reason, cached_tokens=t.cached_tokens))
    return response


def served_model_name(config: FrontendConfig) -> str:
    """The model's name in the HTTP API: --served-model-name, else the GGUF file's stem or the
    model directory's name."""
    if config.served_model_name:
        return config.served_model_name
    files = resolve_model(config.engine.model)
    return Path(files.gguf_file).stem if files.gguf_file else files.directory.name


@dataclass
class Frontend:
    """A running frontend: its gRPC server, port, health servicer, the HTTP API (None when
    off) and, once loaded, the backend."""

    server: grpc.Server
    port: int
    servicer: GenerationServicer
    health: health.HealthServicer
    http: HttpServer | None = None
    backend: Backend | None = None

    @property
    def http_url(self) -> str | None:
        return None if self.http is None else self.http.url

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (SERVICE_NAME, ""):
            self.health.set(service, status)
        if self.http is not None and not serving and self.http.api.state == "serving":
            self.http.api.state = "draining"

    def load(self, loaded=None) -> None:
        """Loads the model and builds the backend (an engine loop here, or the Ray workers),
        then reports SERVING."""
        config = self.servicer.config
        engine_config = config.engine
        if config.ray is not None:
            # Imported here: the single-process server never loads Ray.
            from sssd.verifier.serving.ray_backend import RayBackend

            self.backend = RayBackend(engine_config, config.ray, config.max_requests,
                                      publish=config.publish).start()
            tokenizer = load_tokenizer(engine_config.model)
        else:
            # Imported here: with Ray the engine (and torch) live in the workers only.
            from sssd.verifier.serving.assembly import build_engine_loop

            def build():  # off the main thread: only the engine's thread keeps OpenMP workers
                model = loaded or load_causal_lm(engine_config.model, engine_config.dtype,
                                                 engine_config.device)
                return model, build_engine_loop(engine_config, model, config.max_requests,
                                                publish=config.publish)

            model, self.backend = off_main_thread(build)
            tokenizer = model.tokenizer
        self.servicer.attach(self.backend, tokenizer)
        if self.http is not None:
            self.http.api.attach(self.backend, tokenizer)
        self.set_serving(True)

    def stop(self, grace_s: float) -> None:
        """Stops admitting, lets running requests finish for grace_s, then cancels the rest.

        While draining the server still answers: health says NOT_SERVING and new requests get
        UNAVAILABLE, so load balancers and retrying clients move on."""
        self.set_serving(False)
        if self.backend is not None:
            self.backend.drain()
            deadline = time.monotonic() + grace_s
            while self.backend.num_requests and time.monotonic() < deadline:
                time.sleep(0.05)
        self.server.stop(1.0).wait()  # whatever is left is cancelled
        if self.http is not None:
            self.http.stop()
        if self.backend is not None:
            self.backend.close()


def start_frontend(config: FrontendConfig) -> Frontend:
    """Starts the gRPC server and the HTTP API at once (health NOT_SERVING, HTTP /health 503);
    call `load()` to serve."""
    metrics = ApiMetrics(served_model_name(config))
    http = None
    if config.http:
        api = OpenAIApi(metrics.model_name, config.max_tokens_limit, config.default_max_tokens,
                        config.max_workers, metrics, config.api_key, config.open_health)
        http = HttpServer(api, config.host, config.http_port, tls.resolve(None)).start()
    servicer = GenerationServicer(config, metrics)
    # Health checking and reflection stay open without the key (probes cannot send it).
    interceptors = [ApiKeyInterceptor(ApiKey(config.api_key), (SERVICE_NAME,))] \
        if config.api_key else []
    server = grpc.server(futures.ThreadPoolExecutor(config.max_workers,
                                                    thread_name_prefix="generate-rpc"),
                         interceptors=interceptors)
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME), server)
    host = f"[{config.host}]" if ":" in config.host else config.host
    port = tls.bind(server, f"{host}:{config.port}")
    server.start()
    frontend = Frontend(server, port, servicer, health_servicer, http)
    frontend.set_serving(False)
    return frontend


def serve(config: FrontendConfig) -> None:
    """Serves until SIGTERM or SIGINT, then drains for config.grace_s seconds."""
    frontend = start_frontend(config)
    logger.info("generation API listening on %s%s (loading the model)",
                address(config.host, frontend.port),
                f", OpenAI-compatible HTTP API on {frontend.http_url}" if frontend.http else "")
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        frontend.load()
        logger.info("serving on %s:%d", config.host, frontend.port)
        stopping.wait()
        logger.info("stopping: grace %.1f s", config.grace_s)
    finally:
        frontend.stop(config.grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
