"""`EngineLoop`: one thread that owns an engine and streams every request's tokens out.

Serving threads (gRPC handlers, a Ray decode worker) `submit` requests and read their
`RequestHandle.events`; only the loop thread touches the engine, so the engine needs no locks.
Each engine step returns a `StepOutput`; from it the loop pushes, for every request that got
tokens, one `StreamEvent` with the new token ids, the text delta and the step's statistics, and
hands it to the observers (metrics, the conversation sink). The last event of a request carries
its totals, or its error. `cancel` drops a request before the next step and ends its stream.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from sssd.verifier.engine.detokenizer import stream_safe_end
from sssd.verifier.engine.engine import Engine
from sssd.verifier.engine.handoff import PrefilledPrompt
from sssd.verifier.engine.output import RowOutput, StepOutput
from sssd.verifier.engine.request import GenerateRequest, RequestLimits
from sssd.verifier.engine.sequence import Sequence
from sssd.verifier.serving.backend import (
    Admission,
    EngineGauges,
    RequestHandle,
    StepInfo,
    StreamEvent,
    request_totals,
)
from sssd.verifier.serving.errors import Draining, ErrorKind, StreamError
from sssd.verifier.serving.observers import LoopObserver

logger = logging.getLogger(__name__)

# While idle the loop still wakes this often so observers can re-report their gauges (Ray drops
# a gauge from its Prometheus export about 10 s after its last update).
IDLE_TICK_S = 2.0


@dataclass
class _Stream:
    """The loop's side of one request: what it has sent so far."""

    handle: RequestHandle
    request: GenerateRequest
    seq: Sequence | None = None  # once the engine holds it
    sent_tokens: int = 0
    sent_text: int = 0  # characters of the answer already sent


class EngineLoop:
    """A `Backend` (backend.py) around one engine in this process."""

    def __init__(self, engine: Engine, max_requests: int = 64,
                 observer: LoopObserver | None = None) -> None:
        """`max_requests` bounds running + queued requests."""
        self.engine = engine
        self.observer = observer or LoopObserver()
        self.admission = Admission(max_requests, engine.limits)
        self._streams: dict[str, _Stream] = {}  # the loop thread's; the inbox feeds it
        self._inbox: list[tuple[_Stream, PrefilledPrompt | None]] = []
        self._cancels: list[str] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- serving threads -----------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        return self.engine.limits

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, request: GenerateRequest, request_id: str | None = None,
               prefilled: PrefilledPrompt | None = None, events=None) -> RequestHandle:
        """Queues a request; `prefilled` is its prompt's KV cache from a prefill worker.
        `events`: where its events go instead of the handle's own queue (anything with a
        `put(event)`; a Ray decode worker batches its requests' events this way)."""
        if self._stopped:
            raise Draining("the server is shutting down")
        handle = self.admission.admit(request, request_id)
        if events is not None:
            handle.events = events
        with self._cond:
            # A resumed answer's text up to resume_text_chars is with the client already.
            stream = _Stream(handle, request, sent_text=request.resume_text_chars)
            self._inbox.append((stream, prefilled))
            self._cond.notify()
        return handle

    def cancel(self, request_id: str) -> None:
        handle = self.admission.get(request_id)
        if handle is None or handle.done:
            return
        with self._cond:
            self._cancels.append(request_id)
            self._cond.notify()

    def has_request(self, request_id: str) -> bool:
        """True while the request is queued or running (not finished, not cancelled)."""
        return self.admission.get(request_id) is not None

    @property
    def num_requests(self) -> int:
        return self.admission.num_requests

    def drain(self) -> None:
        self.admission.drain()

    def engine_gauges(self) -> EngineGauges:
        """Read from any thread: each figure is one read of a number the loop keeps."""
        engine = self.engine
        running = engine.num_running
        return EngineGauges(engine.kv_cache_usage, running,
                            max(0, self.admission.num_requests - running),
                            engine.num_preemptions)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the loop, then releases what it was built with: the engine's proposer and
        the observers' resources (e.g. the live datastore's publisher, which sends what Redis
        takes and leaves the rest in its spool)."""
        self.stop(timeout)
        self.engine.close()
        self.observer.close()

    # --- the loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._stopped or self._inbox or self._cancels or engine.has_work()):
                    if not self._cond.wait(timeout=IDLE_TICK_S):
                        break  # idle: one pass to refresh the observers' gauges
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
            for stream, prefilled in inbox:
                self._streams[stream.handle.request_id] = stream
                try:
                    stream.seq = engine.add_request(stream.request, stream.handle.request_id,
                                                    prefilled)
                except ValueError as exc:  # checked at admission; a last line of defence
                    self._finish(stream, error=StreamError(ErrorKind.INVALID_ARGUMENT, str(exc)))
            for request_id in cancels:
                seq = engine.abort(request_id)
                if seq is not None:
                    self._finish(self._streams[request_id])
            self.observer.on_queue(self.engine_gauges())
            if not engine.has_work():
                continue
            start = time.perf_counter()
            try:
                step = engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug must not hang every stream
                logger.exception("engine step failed")
                for request_id in list(self._streams):
                    engine.abort(request_id)
                    self._finish(self._streams[request_id], error=StreamError(
                        ErrorKind.INTERNAL, f"engine failure: {exc}"))
                continue
            self.observer.on_step(step, time.perf_counter() - start)
            self._publish(step)
        for stream in list(self._streams.values()):  # stopped: end every open stream
            self._finish(stream, error=StreamError(ErrorKind.STOPPED, "the server stopped"))

    def _publish(self, step: StepOutput) -> None:
        """Streams what the step produced; ends the streams of finished sequences."""
        finished = {seq.request_id for seq in step.finished}
        draft_ms, verify_ms = 1e3 * step.draft_s, 1e3 * step.verify_s
        for row in step.rows:
            stream = self._streams[row.request_id]
            info = StepInfo(row.num_accepted, row.budget, draft_ms, verify_ms, row.num_drafted) \
                if row.is_verified else None
            self._push(stream, row, info, row.request_id in finished)
        for seq in step.finished:
            self._finish(self._streams[seq.request_id])

    def _push(self, stream: _Stream, row: RowOutput, info: StepInfo | None,
              is_finished: bool) -> None:
        """Sends the row's tokens and the text that can no longer change."""
        if not row.token_ids:
            return
        handle = stream.handle
        if handle.first_token_at is None:
            handle.first_token_at = time.perf_counter()
        text = row.text
        # While running, a tail that could still become a stop string is held back.
        end = len(text) if is_finished else stream_safe_end(text, stream.request.stop)
        delta = text[stream.sent_text:end] if end > stream.sent_text else ""
        stream.sent_text = max(stream.sent_text, end)
        cached = stream.seq.num_cached_tokens if stream.sent_tokens == 0 and stream.seq else None
        stream.sent_tokens += len(row.token_ids)
        handle.events.put(StreamEvent(row.token_ids, delta, info, num_cached_tokens=cached,
                                      logprobs=row.logprobs))

    def _finish(self, stream: _Stream, error: StreamError | None = None) -> None:
        handle = stream.handle
        if handle.done:
            return
        handle.done = True
        self._streams.pop(handle.request_id, None)
        self.admission.release(handle.request_id)
        seq = stream.seq
        if error is not None or seq is None:
            error = error or StreamError(ErrorKind.INTERNAL, "failed")
            handle.events.put(StreamEvent([], "", error=error))
            self.observer.on_finish(seq, None, error)
            return
        # Over this engine's steps: a resumed answer's first tokens came from elsewhere.
        num_decoded = len(seq.output_ids) - seq.num_resumed - 1
        totals = request_totals(handle, len(seq.output_ids), seq.finish_reason or "stop",
                                time.perf_counter(), num_decoded,
                                num_decoded / seq.num_steps if seq.num_steps else 0.0,
                                seq.num_cached_tokens or 0)
        handle.events.put(StreamEvent([], "", totals=totals))
        self.observer.on_finish(seq, totals, None)
