"""`EngineLoop`: one thread that owns an engine and streams every request's tokens out.

Serving threads (gRPC handlers) `submit` requests and read their `RequestHandle.events`; only the
loop thread touches the engine, so the engine needs no locks. Each verification step pushes, for
every request that got tokens, one `StreamEvent` with the new token ids, the text delta and the
step's statistics; the last event of a request carries its totals. `cancel` drops a request
before the next step and ends its stream at once.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

from sssd.verifier.engine import Engine
from sssd.verifier.handoff import PrefilledPrompt
from sssd.verifier.sampling import SamplingParams
from sssd.verifier.sequence import Sequence
from sssd.verifier.totals import Totals

logger = logging.getLogger(__name__)


# While idle the loop still wakes this often so observers can re-report their gauges (Ray drops
# a gauge from its Prometheus export about 10 s after its last update).
IDLE_TICK_S = 2.0


class Overloaded(RuntimeError):
    """The loop already holds its maximum of requests."""


class Draining(RuntimeError):
    """The loop is shutting down and admits nothing new."""


@dataclass(frozen=True)
class StepInfo:
    accepted_tokens: int  # draft tokens accepted in the step
    budget: int  # speculation budget of the step (1: none)
    draft_ms: float
    verify_ms: float


@dataclass(frozen=True)
class StreamEvent:
    token_ids: list[int]
    text: str  # text delta
    step: StepInfo | None = None  # None for the prefill token
    totals: Totals | None = None  # only in the last event
    error: str | None = None  # the request failed inside the loop (last event)


@dataclass
class RequestHandle:
    request_id: str
    num_prompt_tokens: int
    arrival: float
    events: queue.Queue = field(default_factory=queue.Queue)  # StreamEvent
    sent_tokens: int = 0
    sent_text: int = 0  # characters of the answer already sent
    first_token_at: float | None = None
    done: bool = False


class LoopObserver:
    """Hooks for metrics; called on the loop thread, so they must be quick. No-ops here."""

    def on_step(self, engine: Engine, step: StepInfo, step_s: float, num_rows: int,
                num_tokens: int, num_accepted: int) -> None:
        """After a verification step over `num_rows` sequences that emitted `num_tokens`."""

    def on_finish(self, totals: Totals | None, error: str | None,
                  seq: Sequence | None = None) -> None:
        """A request ended: with its totals (and its sequence), or with an error."""

    def on_queue(self, num_waiting: int, num_running: int) -> None:
        """The number of queued (not yet admitted) and running requests, once per loop pass."""

    def close(self) -> None:
        """The loop has stopped: release resources (connections, background threads)."""


class Observers(LoopObserver):
    """Several observers as one, called in order."""

    def __init__(self, *observers: LoopObserver) -> None:
        self.observers = observers

    def on_step(self, *args, **kwargs) -> None:
        for observer in self.observers:
            observer.on_step(*args, **kwargs)

    def on_finish(self, *args, **kwargs) -> None:
        for observer in self.observers:
            observer.on_finish(*args, **kwargs)

    def on_queue(self, *args, **kwargs) -> None:
        for observer in self.observers:
            observer.on_queue(*args, **kwargs)

    def close(self) -> None:
        for observer in self.observers:
            observer.close()


class EngineLoop:
    def __init__(self, engine: Engine, decode: Callable[[list[int]], str],
                 max_requests: int = 64, observer: LoopObserver | None = None) -> None:
        """`decode(ids)` gives the answer text of token ids (special tokens skipped);
        `max_requests` bounds running + queued requests."""
        self.engine = engine
        self.decode = decode
        self.max_requests = max_requests
        self.observer = observer or LoopObserver()
        self._handles: dict[str, RequestHandle] = {}
        self._sequences: dict[str, Sequence] = {}
        self._inbox: list[tuple[RequestHandle, dict]] = []
        self._cancels: list[str] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._draining = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- serving threads -----------------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, prompt_ids: Seq[int], max_tokens: int, sampling: SamplingParams,
               stop: Seq[str] = (), speculate: bool = True, request_id: str | None = None,
               prefilled: PrefilledPrompt | None = None) -> RequestHandle:
        """Queues a request; `prefilled` is its prompt's KV cache from a prefill worker."""
        with self._cond:
            if self._draining or self._stopped:
                raise Draining("the server is shutting down")
            if len(self._handles) >= self.max_requests:
                raise Overloaded(f"the server holds its maximum of {self.max_requests} "
                                 "concurrent requests")
            request_id = request_id or f"g{next(self._ids)}"
            if request_id in self._handles:
                raise ValueError(f"request id {request_id!r} is already in use")
            handle = RequestHandle(request_id, len(prompt_ids), time.perf_counter())
            self._handles[handle.request_id] = handle
            self._inbox.append((handle, dict(prompt_ids=list(prompt_ids), max_tokens=max_tokens,
                                             sampling=sampling, stop=tuple(stop),
                                             speculate=speculate, prefilled=prefilled)))
            self._cond.notify()
        return handle

    def cancel(self, request_id: str) -> None:
        """Ends the request's stream now; idempotent, and a no-op for finished requests."""
        with self._cond:
            handle = self._handles.get(request_id)
            if handle is None or handle.done:
                return
            self._cancels.append(request_id)
            self._cond.notify()

    def has_request(self, request_id: str) -> bool:
        """True while the request is queued or running (not finished, not cancelled)."""
        with self._cond:
            return request_id in self._handles

    @property
    def num_requests(self) -> int:
        with self._cond:
            return len(self._handles)

    def drain(self) -> None:
        """Stops admitting; running requests go on."""
        with self._cond:
            self._draining = True

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the loop, then releases what it was built with: the proposer's connection and
        the observers' resources (e.g. the live datastore's publisher, which sends what Redis
        takes and leaves the rest in its spool)."""
        self.stop(timeout)
        proposer = self.engine.proposer
        if proposer is not None and hasattr(proposer, "close"):
            proposer.close()
        self.observer.close()

    # --- the loop thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._inbox or self._cancels
                           or self.engine.has_work()):
                    if not self._cond.wait(timeout=IDLE_TICK_S):
                        break  # idle: one pass to refresh the observers' gauges
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            for handle, request in inbox:
                try:
                    seq = self.engine.add_request(request_id=handle.request_id, **request)
                except ValueError as exc:  # validated by the caller; a last line of defence
                    self._finish(handle, None, error=str(exc))
                    continue
                self._sequences[handle.request_id] = seq
            for request_id in cancels:
                seq = self.engine.abort(request_id)
                if seq is not None:
                    self._finish(self._handles[request_id], seq)
            self.observer.on_queue(len(self.engine.waiting), len(self.engine.running))
            if not self.engine.has_work():
                continue
            stats = self.engine.stats
            tokens_before, accepted_before = stats.num_tokens, stats.num_accepted
            rows_before, steps_before = stats.num_row_steps, stats.num_steps
            start = time.perf_counter()
            try:
                finished = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug must not hang every stream
                logger.exception("engine step failed")
                for request_id in list(self._sequences):
                    self.engine.abort(request_id)
                    self._finish(self._handles[request_id], None, error=f"engine failure: {exc}")
                continue
            step = StepInfo(0, self.engine.last_budget, 1e3 * self.engine.last_draft_s,
                            1e3 * self.engine.last_verify_s)
            if stats.num_steps > steps_before:  # a verification step ran (not only admissions)
                self.observer.on_step(self.engine, step, time.perf_counter() - start,
                                      stats.num_row_steps - rows_before,
                                      stats.num_tokens - tokens_before,
                                      stats.num_accepted - accepted_before)
            for seq in self.engine.running:
                self._push(self._handles[seq.request_id], seq, step)
            for seq in finished:
                self._push(self._handles[seq.request_id], seq, step)
                self._finish(self._handles[seq.request_id], seq)
        for request_id in list(self._sequences):  # stopped: end every open stream
            self._finish(self._handles[request_id], self._sequences[request_id],
                         error="the server stopped")

    def _push(self, handle: RequestHandle, seq: Sequence, step: StepInfo) -> None:
        """Sends the tokens and text the sequence gained since the last event."""
        new_tokens = seq.output_ids[handle.sent_tokens:]
        if not new_tokens:
            return
        now = time.perf_counter()
        if handle.first_token_at is None:
            handle.first_token_at = now
        text = self._text(seq)
        delta = text[handle.sent_text:]
        handle.sent_text = len(text)
        # The first event holds the prefill token and, if it was already in the batch, a step.
        is_first = handle.sent_tokens == 0
        handle.sent_tokens = len(seq.output_ids)
        info = StepInfo(seq.last_accepted, seq.last_budget, step.draft_ms, step.verify_ms) \
            if seq.num_steps and not (is_first and len(new_tokens) == 1) else None
        handle.events.put(StreamEvent(new_tokens, delta, info))

    def _text(self, seq: Sequence) -> str:
        """Answer text safe to send: cut at a matched stop string; while running, hold back an
        incomplete character and any tail that could still become a stop string."""
        text = self.decode(seq.output_ids)
        if seq.stop_text_len is not None:
            return text[: seq.stop_text_len]
        if seq.is_finished:
            return text
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        for stop in seq.stop:
            for size in range(min(len(stop) - 1, end), 0, -1):
                if text.endswith(stop[:size], 0, end):
                    end -= size
                    break
        return text[:end]

    def _finish(self, handle: RequestHandle, seq: Sequence | None,
                error: str | None = None) -> None:
        if handle.done:
            return
        handle.done = True
        self._sequences.pop(handle.request_id, None)
        with self._cond:
            self._handles.pop(handle.request_id, None)
        if error is not None or seq is None:
            handle.events.put(StreamEvent([], "", error=error or "failed"))
            self.observer.on_finish(None, error or "failed")
            return
        now = time.perf_counter()
        first = handle.first_token_at or now
        completion = len(seq.output_ids)
        decode_s = now - first
        totals = Totals(
            prompt_tokens=handle.num_prompt_tokens, completion_tokens=completion,
            time_to_first_token_s=first - handle.arrival, total_s=now - handle.arrival,
            tokens_per_second=(completion - 1) / decode_s if completion > 1 and decode_s > 0
            else 0.0,
            mean_accepted_length=(completion - 1) / seq.num_steps if seq.num_steps else 0.0,
            finish_reason=seq.finish_reason or "stop")
        handle.events.put(StreamEvent([], "", totals=totals))
        self.observer.on_finish(totals, None, seq)
