"""What the gRPC frontend serves from: the `Backend` protocol and the types it streams.

Two backends implement it: `EngineLoop` (the engine in this process) and `RayBackend` (prefill
and decode workers as Ray actors). `Admission` is the admission control both use: the drain
state, the concurrency limit, request ids and the model's request limits.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from sssd.common.rpc.totals import Totals
from sssd.verifier.engine.request import GenerateRequest, RequestLimits
from sssd.verifier.engine.token_logprob import TokenLogprob
from sssd.verifier.serving.errors import Draining, Overloaded, StreamError


@dataclass(frozen=True)
class StepInfo:
    """Per-step statistics of one request's stream event."""

    accepted_tokens: int  # draft tokens accepted in the step
    budget: int  # the row's speculation budget (1: none)
    draft_ms: float
    verify_ms: float
    drafted_tokens: int = 0  # draft tokens verified in the step (the tree's nodes but its root)


@dataclass(frozen=True)
class StreamEvent:
    token_ids: list[int]
    text: str  # text delta
    step: StepInfo | None = None  # None for an event holding only the prefill token
    totals: Totals | None = None  # only in the last event of a request that ended normally
    error: StreamError | None = None  # only in the last event of a request that failed
    # Only in a request's first event with tokens: its leading prompt tokens whose keys and
    # values came from the prefix cache instead of being computed.
    num_cached_tokens: int | None = None
    # [len(token_ids)] when the request asked for log-probabilities, else None.
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class EngineGauges:
    """Where the engines behind a backend stand (what vLLM's server exports under the same
    names): the KV cache's use, the requests in the running batch and those queued."""

    kv_cache_usage: float  # fraction of the KV cache's blocks held by requests, 0..1
    num_running: int  # in the running batch (decoding or being prefilled)
    num_waiting: int  # submitted, not yet in the running batch
    num_preemptions: int = 0  # all time: requests preempted for want of KV blocks


@dataclass
class RequestHandle:
    """A submitted request, as its submitter sees it: read `events` until the last one."""

    request_id: str
    num_prompt_tokens: int
    arrival: float  # time.perf_counter() at submission
    events: queue.Queue = field(default_factory=queue.Queue)  # StreamEvent
    first_token_at: float | None = None
    done: bool = False


def request_totals(handle: RequestHandle, completion_tokens: int, finish_reason: str, now: float,
                   num_decoded: int | None = None, mean_accepted_length: float = 0.0,
                   cached_tokens: int = 0) -> Totals:
    """The totals of a request that ended at `now` (time.perf_counter()), timed as its submitter
    saw it: from its arrival and `handle.first_token_at`. The decoding rate counts
    `num_decoded` tokens after the first token (default: all but the first)."""
    first = handle.first_token_at or now
    decode_s = now - first
    if num_decoded is None:
        num_decoded = completion_tokens - 1
    return Totals(prompt_tokens=handle.num_prompt_tokens, completion_tokens=completion_tokens,
                  time_to_first_token_s=first - handle.arrival, total_s=now - handle.arrival,
                  tokens_per_second=num_decoded / decode_s
                  if num_decoded > 0 and decode_s > 0 else 0.0,
                  mean_accepted_length=mean_accepted_length, finish_reason=finish_reason,
                  cached_tokens=cached_tokens)


class Backend(Protocol):
    @property
    def limits(self) -> RequestLimits:
        """What requests may ask of the model behind this backend."""
        ...

    def submit(self, request: GenerateRequest) -> RequestHandle:
        """Queues a request. Raises InvalidRequest, Overloaded or Draining; never blocks."""
        ...

    def cancel(self, request_id: str) -> None:
        """Ends the request's stream now; idempotent, a no-op for finished requests."""
        ...

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet ended."""
        ...

    def drain(self) -> None:
        """Admits nothing new; running requests go on."""
        ...

    def engine_gauges(self) -> EngineGauges | None:
        """The engines' gauges now; None when they cannot be read (a worker is away)."""
        ...

    def close(self) -> None:
        """Stops serving and releases everything the backend holds."""
        ...


class Admission:
    """Admission control, written once for every backend. Thread-safe."""

    def __init__(self, max_requests: int, limits: RequestLimits) -> None:
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        self.max_requests = max_requests
        self.limits = limits
        self._handles: dict[str, RequestHandle] = {}
        self._lock = threading.Lock()
        self._is_draining = False
        self._ids = itertools.count()
        # Ids stay unique across backends and restarts (they key the live datastore's
        # once-per-request publishing, for a day).
        self._prefix = os.urandom(8).hex()

    def admit(self, request: GenerateRequest, request_id: str | None = None) -> RequestHandle:
        """A handle for the request, or InvalidRequest / Overloaded / Draining."""
        self.limits.check(request)
        with self._lock:
            if self._is_draining:
                raise Draining("the server is shutting down")
            if len(self._handles) >= self.max_requests:
                raise Overloaded(f"the server holds its maximum of {self.max_requests} "
                                 "concurrent requests")
            request_id = request_id or f"r{self._prefix}-{next(self._ids)}"
            if request_id in self._handles:
                raise ValueError(f"request id {request_id!r} is already in use")
            handle = RequestHandle(request_id, len(request.prompt_ids), time.perf_counter())
            self._handles[request_id] = handle
        return handle

    def release(self, request_id: str) -> RequestHandle | None:
        """Forgets an ended request; returns its handle (None if already released)."""
        with self._lock:
            return self._handles.pop(request_id, None)

    def get(self, request_id: str) -> RequestHandle | None:
        with self._lock:
            return self._handles.get(request_id)

    def drain(self) -> None:
        with self._lock:
            self._is_draining = True

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._handles)
