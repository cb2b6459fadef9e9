"""The public gRPC API (proto/sssd/v1/generate.proto) in front of an engine loop or Ray workers.

Single-process mode (`FrontendConfig.ray` is None): the frontend, the engine loop and
(optionally) an in-process drafter share one process; a remote drafter service is used when
`drafter_target` is set. Ray mode: prefill and decode workers are Ray actors (ray_serving.py)
behind a `RayBackend`, which has the engine loop's interface. The servicer
validates each request into engine terms (every bad field is INVALID_ARGUMENT naming the field
and its allowed range), submits it to the loop and streams the loop's events back. The RPC's
termination callback cancels the request, so a client cancel or an expired deadline frees the
sequence at once.
"""

from __future__ import annotations

import logging
import math
import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sssd.verifier.config import EngineConfig
from sssd.verifier.loop import Draining, EngineLoop, Overloaded, StreamEvent
from sssd.verifier.ray_serving import RayBackend, RayConfig

if TYPE_CHECKING:
    from sssd.indexer.sink import PublishConfig
from sssd.verifier.sampling import SamplingParams
from sssd.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS, MAX_STOP_LEN = 8, 256


@dataclass(frozen=True)
class FrontendConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 50061  # 0: the OS picks (tests)
    max_requests: int = 64  # running + queued; beyond it RESOURCE_EXHAUSTED
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask for
    default_max_tokens: int = 256
    grace_s: float = 10.0  # SIGTERM: running requests get this long to finish
    max_workers: int = 80  # gRPC handler threads (> max_requests, so refusals are answered)
    ray: RayConfig | None = None  # None: single process; else prefill/decode Ray workers
    # Completed conversations to the Redis stream of the live datastore (None: not published).
    publish: "PublishConfig | None" = None

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("need 1 <= default_max_tokens <= max_tokens_limit")
        if self.max_requests < 1 or self.max_workers <= self.max_requests:
            raise ValueError("need max_requests >= 1 and max_workers > max_requests")


class BadRequest(ValueError):
    """A request field is out of range; the message names the field and the range."""


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.loop: EngineLoop | RayBackend | None = None  # set once the model is loaded
        self.tokenizer = None
        self.max_prompt_tokens = 0
        self.vocab_size = 0

    def attach(self, loop: EngineLoop | RayBackend, tokenizer, max_len: int,
               vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_prompt_tokens = max_len - 2  # room for at least one new token and its tree root
        self.loop = loop

    def Generate(self, request: generate_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[generate_pb2.GenerateResponse]:
        loop = self.loop
        if loop is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        try:
            prompt_ids, max_tokens, sampling, stop, speculate = self.parse(request)
            handle = loop.submit(prompt_ids, max_tokens, sampling, stop, speculate)
        except BadRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Overloaded as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except Draining as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        # Runs as soon as the RPC ends for any reason (client cancel, deadline, normal end),
        # even while this thread waits for the next event; the finally covers the rest.
        context.add_callback(lambda: loop.cancel(handle.request_id))
        try:
            while True:
                try:
                    event: StreamEvent = handle.events.get(timeout=1.0)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if event.error is not None:
                    context.abort(grpc.StatusCode.CANCELLED if "stopped" in event.error
                                  else grpc.StatusCode.INTERNAL, event.error)
                yield to_response(event)
                if event.totals is not None:
                    return
        finally:
            loop.cancel(handle.request_id)  # a no-op once the request finished

    def parse(self, request: generate_pb2.GenerateRequest):
        """The request in engine terms, or BadRequest naming the field and its range."""
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise BadRequest("prompt: set one of text, chat or tokens")
        if kind == "text":
            if not request.text.strip():
                raise BadRequest("prompt.text: must not be empty")
            messages = [{"role": "user", "content": request.text}]
            prompt_ids = self._chat_ids(messages)
        elif kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not any(m["content"].strip() for m in messages):
                raise BadRequest("prompt.chat.messages: need at least one non-empty message")
            for index, message in enumerate(messages):
                if message["role"] not in CHAT_ROLES:
                    raise BadRequest(f"prompt.chat.messages[{index}].role: {message['role']!r} "
                                     f"is not one of {', '.join(CHAT_ROLES)}")
            prompt_ids = self._chat_ids(messages)
        else:
            prompt_ids = list(request.tokens.token_ids)
            if not prompt_ids:
                raise BadRequest("prompt.tokens.token_ids: must not be empty")
            bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"prompt.tokens.token_ids: {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if len(prompt_ids) > self.max_prompt_tokens:
            raise BadRequest(f"prompt: {len(prompt_ids)} tokens, the context window allows at "
                             f"most {self.max_prompt_tokens}")
        limit = self.config.max_tokens_limit
        max_tokens = request.max_tokens or self.config.default_max_tokens
        if not 1 <= max_tokens <= limit:
            raise BadRequest(f"max_tokens: {max_tokens} is outside [1, {limit}] (0 = default "
                             f"{self.config.default_max_tokens})")
        temperature = request.temperature
        if not math.isfinite(temperature) or temperature < 0:
            raise BadRequest(f"temperature: {temperature} must be >= 0 (0 = greedy)")
        top_p = request.top_p if request.HasField("top_p") else 1.0
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise BadRequest(f"top_p: {top_p} is outside (0, 1]")
        stop = list(request.stop)
        if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LEN for s in stop):
            raise BadRequest(f"stop: at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_LEN} "
                             "characters")
        seed = request.seed if request.HasField("seed") else None
        sampling = SamplingParams(temperature=float(temperature), top_p=float(top_p),
                                  top_k=int(request.top_k), seed=seed)
        speculate = request.speculation != generate_pb2.SPECULATION_MODE_OFF
        return prompt_ids, max_tokens, sampling, stop, speculate

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        from sssd.common.corpus import conversation_token_ids

        return conversation_token_ids(self.tokenizer, messages, add_generation_prompt=True)


def to_response(event: StreamEvent) -> generate_pb2.GenerateResponse:
    response = generate_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids)
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
            finish_reason=t.finish_reason))
    return response


@dataclass
class Frontend:
    """A running frontend: its gRPC server, port, health servicer and (once loaded) loop."""

    server: grpc.Server
    port: int
    servicer: GenerationServicer
    health: health.HealthServicer
    loop: EngineLoop | RayBackend | None = None

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (SERVICE_NAME, ""):
            self.health.set(service, status)

    def load(self, loaded=None) -> None:
        """Loads the model, builds the engine and its loop (or starts the Ray workers), then
        reports SERVING."""
        from sssd.common.model_loader import load_causal_lm
        from sssd.verifier.factory import build_engine_loop

        config = self.servicer.config
        engine_config = config.engine
        if config.ray is not None:
            from sssd.common.tokenizer import load_tokenizer

            backend = RayBackend(engine_config, config.ray, config.max_requests,
                                 publish=config.publish).start()
            self.loop = backend
            self.servicer.attach(backend, load_tokenizer(engine_config.model),
                                 engine_config.max_len, backend.vocab_size)
            self.set_serving(True)
            return
        loaded = loaded or load_causal_lm(engine_config.model, engine_config.dtype)
        self.loop = build_engine_loop(engine_config, loaded, config.max_requests,
                                      publish=config.publish)
        self.servicer.attach(self.loop, loaded.tokenizer, engine_config.max_len,
                             loaded.vocab_size)
        self.set_serving(True)

    def stop(self, grace_s: float) -> None:
        """Stops admitting, lets running requests finish for grace_s, then cancels the rest.

        While draining the server still answers: health says NOT_SERVING and new requests get
        UNAVAILABLE, so load balancers and retrying clients move on."""
        self.set_serving(False)
        if self.loop is not None:
            self.loop.drain()
            deadline = time.monotonic() + grace_s
            while self.loop.num_requests and time.monotonic() < deadline:
                time.sleep(0.05)
        self.server.stop(1.0).wait()  # whatever is left is cancelled
        if self.loop is not None:
            self.loop.close()


def start_frontend(config: FrontendConfig) -> Frontend:
    """Starts the gRPC server at once (health NOT_SERVING); call `load()` to serve."""
    servicer = GenerationServicer(config)
    server = grpc.server(futures.ThreadPoolExecutor(config.max_workers,
                                                    thread_name_prefix="generate-rpc"))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME), server)
    host = f"[{config.host}]" if ":" in config.host else config.host
    port = server.add_insecure_port(f"{host}:{config.port}")
    server.start()
    frontend = Frontend(server, port, servicer, health_servicer)
    frontend.set_serving(False)
    return frontend


def serve(config: FrontendConfig) -> None:
    """Serves until SIGTERM or SIGINT, then drains for config.grace_s seconds."""
    frontend = start_frontend(config)
    logger.info("generation API on %s:%d (loading the model)", config.host, frontend.port)
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
