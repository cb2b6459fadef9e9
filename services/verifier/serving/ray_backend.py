"""Prefill/decode disaggregation on Ray (docs/services/verifier.md).

    frontend (gRPC, this process)
      |  1. prefill.prefill(prompt_ids)  -> ObjectRef[PrefilledPrompt]   (prefill worker)
      |  2. decode.submit(id, request, that ref, subscriber)                (decode worker)
      |  3. decode.events(subscriber): one stream of event batches per decode worker, read by
      |     one thread here, which hands each event to its request's queue
      v
    the client's stream

The frontend passes the prefill's ObjectRef, not the data, to a decode worker, so the KV goes
from the prefill worker's store straight to the decode worker (on the same node it is read in
place, zero-copy) and is copied once, into the decode worker's cache slot (ray_workers.py).
Without prefill workers (`RayConfig.num_prefill_workers` 0, the default on a CPU cluster of
fewer than 4 CPUs: placement.py) step 1 is skipped and the decode worker prefills the prompt
inside its decode steps.

`RayBackend` implements the `Backend` protocol (backend.py), so the gRPC frontend serves it
like the single-process engine loop: the same `Admission` control, then each request goes to
the least-loaded live prefill and decode workers. Starting or joining the cluster: ray_auth.py.

Failover: Ray restarts a worker that dies (`RayConfig.max_worker_restarts`; it reloads the
model). The requests it held do not fail: each goes on with another live worker, which is
prefilled with the prompt and the tokens already streamed (`GenerateRequest.resume_ids`) and
streams what follows, so the client sees no error and no missing or repeated token. Greedy
answers are the same as without the fault; so are seeded sampled ones, whose randomness is a
function of (seed, position), and a request without a seed gets one here, at admission. The
dead worker is taken out of routing until its `ready` answers again (a background probe). A
request moves at most `max_failovers` times; it waits up to `failover_wait_s` when every
worker of a kind is down. Not covered: a worker that dies after its last token and before the
end of the stream of a request ended by a stop string (it would be resumed past the stop
string; ends by EOS or max_tokens are recognised).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, replace

import ray
from ray.exceptions import ObjectLostError, RayActorError

from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.engine.request import GenerateRequest, RequestLimits, end_reason
from sssd.verifier.serving.backend import (
    Admission,
    EngineGauges,
    RequestHandle,
    StreamEvent,
    request_totals,
)
from sssd.verifier.serving.config import RayConfig
from sssd.verifier.serving.errors import ErrorKind, StreamError
from sssd.verifier.serving.placement import plan_workers
from sssd.verifier.serving.ray_auth import init_ray
from sssd.verifier.serving.ray_workers import CANCELLED_BEFORE_SUBMIT, DecodeWorker, PrefillWorker

logger = logging.getLogger(__name__)


@dataclass
class WorkerSlot:
    actor: object  # a Ray actor handle
    name: str
    load: int = 0  # requests in flight
    up: bool = True  # False from a failure until its `ready` answers again

    @property
    def actor_id(self) -> str:
        return self.actor._actor_id.hex()


class _WorkerLost(Exception):
    """A worker died (or its result was lost) during one attempt at a request."""


GAUGES_TIMEOUT_S = 2.0  # a /metrics read waits this long for the decode workers' gauges

# Put in a request's queue by the events reader when its decode worker died.
_LOST = object()


@dataclass
class _Progress:
    """What one request's client already has: the answer's tokens and text characters."""

    token_ids: list
    text_chars: int = 0
    failovers: int = 0


class RayBackend:
    """A `Backend` over Ray prefill and decode workers."""

    def __init__(self, engine_config: EngineConfig, ray_config: RayConfig,
                 max_requests: int = 64, publish=None) -> None:
        """`publish`: the live datastore's PublishConfig, for the decode workers (or None)."""
        self.engine_config = engine_config
        self.publish = publish
        self.ray_config = ray_config
        self.max_requests = max_requests
        self.endpoints: dict = {}
        self.admission: Admission | None = None  # once the workers report their model
        self._prefill: list[WorkerSlot] = []
        self._decode: list[WorkerSlot] = []
        self._workers: dict[str, WorkerSlot] = {}  # request id -> its decode worker
        self._inboxes: dict[str, queue.Queue] = {}  # request id -> its events from the worker
        self._subscriber = secrets.token_hex(8)  # this frontend, to the decode workers
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a worker came back up
        self._closed = threading.Event()
        self._eos_token_ids: frozenset[int] = frozenset()
        self._owns_ray = False
        self.num_failovers = 0  # requests moved to another worker (all time)

    def workers(self, kind: str) -> list[WorkerSlot]:
        """The prefill or the decode workers (each one's actor, and whether it is up), for tools
        that watch or fault them (bench/chaos.py, bench/soak.py)."""
        if kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be 'prefill' or 'decode', got {kind!r}")
        return list(self._prefill if kind == "prefill" else self._decode)

    def start(self, timeout_s: float = 600.0) -> "RayBackend":
        """Starts or joins Ray, creates the workers and waits until each has loaded the model."""
        if not ray.is_initialized():
            self.endpoints = init_ray(self.ray_config)
            self._owns_ray = True
        cfg = self.ray_config
        resources = ray.cluster_resources()
        plan = plan_workers(cfg, self.engine_config.device, resources.get("GPU", 0.0),
                            resources.get("CPU", 0.0))
        num_workers = plan.num_workers
        threads = cfg.torch_threads or max(1, (os.cpu_count() or 1) // num_workers)
        # max_task_retries 0: a call to a dead worker fails at once and the request moves on
        # (failover) instead of waiting for the restart.
        options = dict(num_cpus=cfg.cpus_per_worker, num_gpus=plan.gpus_per_worker,
                       max_restarts=cfg.max_worker_restarts, max_task_retries=0)
        # Ray sets an actor's OMP_NUM_THREADS to its CPU reservation (1), and every thread an
        # actor starts begins with that many OpenMP threads (probed: 1 in a new thread of an
        # actor, 2 once torch ran a parallel operation there): torch.set_num_threads fixes
        # only torch's own operations and the thread that called it, not the engine's kernels
        # (OpenMP in C++) in the decode step thread before torch parallelised anything there.
        env_vars = {"OMP_NUM_THREADS": str(threads)}
        if self._owns_ray and threads * num_workers > (os.cpu_count() or 1):
            # The workers share this machine's cores: OpenMP workers that spin between
            # operations (docs/operations.md, "Threads and OpenMP") would take them from the
            # other worker's, so they sleep instead.
            env_vars["OMP_WAIT_POLICY"] = "PASSIVE"
        options["runtime_env"] = {"env_vars": env_vars}
        prefill_cls = ray.remote(PrefillWorker).options(**options, resources=_pin(
            cfg.prefill_resource))
        # Threads: one per submit call (each waits for its prefilled KV) and per events
        # stream, plus room for cancel and ready calls.
        decode_cls = ray.remote(DecodeWorker).options(
            max_concurrency=self.max_requests + 8, **options,
            resources=_pin(cfg.decode_resource))
        self._prefill = [WorkerSlot(prefill_cls.remote(self.engine_config, f"prefill-{i}",
                                                  threads), f"prefill-{i}")
                         for i in range(plan.num_prefill_workers)]
        self._decode = [WorkerSlot(decode_cls.remote(self.engine_config, f"decode-{i}",
                                                self.max_requests, threads,
                                                publish=self.publish,
                                                own_prefill=not self._prefill),
                              f"decode-{i}")
                        for i in range(plan.num_decode_workers)]
        infos = ray.get([s.actor.ready.remote() for s in self._prefill + self._decode],
                        timeout=timeout_s)
        fingerprints = {info["fingerprint"] for info in infos}
        if len(fingerprints) != 1:
            raise RuntimeError(f"workers loaded models with different tokenizers: {infos}")
        # Every decode worker is built from the one engine config, so they offer the same
        # drafting sources; a request naming another is refused here, before any prefill.
        sources = infos[len(self._prefill)]["sources"]
        # The workers' window: the model's, as far as their KV caches hold it.
        window = min(info["context_window"] for info in infos)
        limits = RequestLimits.for_context(infos[0]["vocab_size"], window, sources)
        self._eos_token_ids = frozenset(infos[len(self._prefill)]["eos_token_ids"])
        self.admission = Admission(self.max_requests, limits)
        for slot in self._decode:
            threading.Thread(target=self._read_events, args=(slot,),
                             name=f"events-{slot.name}", daemon=True).start()
        logger.info("Ray workers ready: %s", ", ".join(
            f"{i['name']} (pid {i['pid']}, {i['device']}, {i['torch_threads']} torch threads)"
            for i in infos))
        return self

    # --- the Backend protocol ---------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        return self._started().limits

    def submit(self, request: GenerateRequest) -> RequestHandle:
        handle = self._started().admit(request)
        if not request.sampling.is_greedy and request.sampling.seed is None:
            # Fixed here, so that a request moved to another worker samples on identically.
            request = replace(request, sampling=replace(request.sampling,
                                                        seed=secrets.randbits(64)))
        threading.Thread(target=self._pump, args=(handle, request),
                         name=f"pump-{handle.request_id}", daemon=True).start()
        return handle

    def cancel(self, request_id: str) -> None:
        if self.admission is None or self.admission.get(request_id) is None:
            return
        with self._lock:
            if request_id in self._cancelled:
                return
            self._cancelled.add(request_id)
            decode = self._workers.get(request_id)
        if decode is not None:
            decode.actor.cancel.remote(request_id)

    @property
    def num_requests(self) -> int:
        return self.admission.num_requests if self.admission is not None else 0

    def drain(self) -> None:
        if self.admission is not None:
            self.admission.drain()
        for slot in self._decode:
            slot.actor.drain.remote()

    def engine_gauges(self, timeout_s: float = GAUGES_TIMEOUT_S) -> EngineGauges | None:
        """The decode workers' gauges together (their KV caches' mean use); requests in a
        prefill worker or on their way count as waiting. None when a worker does not answer
        within `timeout_s`."""
        slots = [slot for slot in self._decode if slot.up]
        if not slots:
            return None
        try:
            each = ray.get([slot.actor.engine_gauges.remote() for slot in slots],
                           timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a worker away: no gauges this time
            return None
        running = sum(g.num_running for g in each)
        return EngineGauges(sum(g.kv_cache_usage for g in each) / len(each), running,
                            max(0, self.num_requests - running),
                            sum(g.num_preemptions for g in each))

    def close(self, timeout: float = 10.0) -> None:
        """Closes the decode workers' loops, ends the workers and a Ray cluster started here."""
        self._closed.set()
        with self._changed:
            self._changed.notify_all()
        if self._decode:
            try:
                ray.get([s.actor.close.remote() for s in self._decode], timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                logger.warning("decode workers did not stop cleanly: %s", exc)
        for slot in self._prefill + self._decode:
            ray.kill(slot.actor)
        self._prefill, self._decode = [], []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def _started(self) -> Admission:
        if self.admission is None:
            raise RuntimeError("RayBackend.start() was not called")
        return self.admission

    # --- routing and failover -------------------------------------------------------------------

    def _take(self, slots: list[WorkerSlot], kind: str, request_id: str) -> WorkerSlot:
        """The least-loaded live worker of `slots` (its load counted); waits for one to come
        back while all are down, up to failover_wait_s."""
        deadline = time.monotonic() + self.ray_config.failover_wait_s
        with self._changed:
            while True:
                live = [slot for slot in slots if slot.up]
                if live:
                    slot = min(live, key=lambda s: s.load)
                    slot.load += 1
                    return slot
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set() or request_id in self._cancelled:
                    raise _WorkerLost(f"no live {kind} worker")
                self._changed.wait(min(left, 1.0))

    def _mark_down(self, slot: WorkerSlot, reason: str) -> None:
        """Takes a worker out of routing; a probe brings it back once `ready` answers."""
        with self._lock:
            if not slot.up:
                return
            slot.up = False
        logger.warning("worker %s is down (%s); routing around it until it answers again",
                       slot.name, reason)
        threading.Thread(target=self._probe, args=(slot,), name=f"probe-{slot.name}",
                         daemon=True).start()

    def _probe(self, slot: WorkerSlot) -> None:
        while not self._closed.is_set():
            try:
                ray.get(slot.actor.ready.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - restarting (model load) or gone: try again
                self._closed.wait(1.0)
                continue
            with self._changed:
                slot.up = True
                self._changed.notify_all()
            logger.info("worker %s is back", slot.name)
            return

    # --- one request ----------------------------------------------------------------------------

    def _pump(self, handle: RequestHandle, request: GenerateRequest) -> None:
        """Runs one request to its end, moving it to other workers when one dies; its events
        go to handle.events."""
        request_id = handle.request_id
        progress = _Progress([])
        try:
            while True:
                try:
                    self._attempt(handle, request, progress)
                    return
                except _WorkerLost as lost:
                    if request_id in self._cancelled or self._closed.is_set():
                        return
                    if self._ended_before(handle, request, progress):
                        return  # nothing left to generate: no failover needed
                    if progress.failovers >= self.ray_config.max_failovers:
                        raise RuntimeError(f"{lost} (moved {progress.failovers} times "
                                           "already)") from None
                    progress.failovers += 1
                    with self._lock:
                        self.num_failovers += 1
                    logger.warning("request %s: %s after %d tokens; going on with another "
                                   "worker", request_id, lost, len(progress.token_ids))
        except Exception as exc:  # noqa: BLE001 - out of failovers, or a bug: fail this request
            logger.warning("request %s failed in a worker: %s", request_id, exc)
            handle.events.put(StreamEvent([], "", error=StreamError(
                ErrorKind.INTERNAL, f"worker failure: {exc}")))
        finally:
            self.admission.release(request_id)
            with self._lock:
                self._workers.pop(request_id, None)
                self._cancelled.discard(request_id)
            handle.done = True

    def _attempt(self, handle: RequestHandle, request: GenerateRequest,
                 progress: _Progress) -> None:
        """One prefill + decode of the request, from what the client already has. Raises
        _WorkerLost when a worker dies or its result is lost."""
        request_id = handle.request_id
        if progress.token_ids:
            request = replace(request, resume_ids=tuple(progress.token_ids),
                              resume_text_chars=progress.text_chars)
        # Without prefill workers the decode worker prefills the prompt itself.
        prefill = self._take(self._prefill, "prefill", request_id) if self._prefill else None
        try:
            decode = self._take(self._decode, "decode", request_id)
        except _WorkerLost:
            if prefill is not None:
                with self._lock:
                    prefill.load -= 1
            raise
        released_prefill = prefill is None
        try:
            kv_ref = prefill.actor.prefill.remote(request.context_ids) \
                if prefill is not None else None
            inbox: queue.Queue = queue.Queue()
            with self._lock:
                self._workers[request_id] = decode
                self._inboxes[request_id] = inbox
                cancelled = request_id in self._cancelled
            if cancelled:
                return
            error = ray.get(decode.actor.submit.remote(request_id, request, kv_ref,
                                                       self._subscriber))
            if not released_prefill:  # the worker has the prefilled KV
                released_prefill = True
                with self._lock:
                    prefill.load -= 1
            if error == CANCELLED_BEFORE_SUBMIT:
                return
            if error is not None:
                handle.events.put(StreamEvent([], "", error=error))
                return
            while True:
                event = inbox.get()
                if event is _LOST:  # the reader marked the worker down
                    # Dead, or alive with a broken stream: then the request stops there.
                    decode.actor.cancel.remote(request_id)
                    raise _WorkerLost(f"worker {decode.name} died")
                now = time.perf_counter()
                if event.token_ids and handle.first_token_at is None:
                    handle.first_token_at = now
                if event.totals is not None:  # timed here: includes the transfers
                    totals = request_totals(handle, event.totals.completion_tokens,
                                            event.totals.finish_reason, now,
                                            mean_accepted_length=event.totals.mean_accepted_length,
                                            cached_tokens=event.totals.cached_tokens)
                    event = replace(event, totals=totals)
                progress.token_ids.extend(event.token_ids)
                progress.text_chars += len(event.text)
                handle.events.put(event)
                if event.totals is not None or event.error is not None:
                    return
        except RayActorError as exc:
            # Which worker: the error names its actor; a failed argument (the prefill's
            # result) surfaces through the decode call, so an unnamed one takes both out.
            workers = [slot for slot in (prefill, decode) if slot is not None]
            dead = [slot for slot in workers if slot.actor_id == exc.actor_id] or workers
            for slot in dead:
                self._mark_down(slot, type(exc).__name__)
            raise _WorkerLost(" and ".join(f"worker {slot.name} died" for slot in dead)) \
                from None
        except ObjectLostError as exc:
            raise _WorkerLost(f"the prefilled KV was lost ({type(exc).__name__})") from None
        finally:
            with self._lock:
                self._inboxes.pop(request_id, None)
                decode.load -= 1
                if not released_prefill:
                    prefill.load -= 1

    def _read_events(self, slot: WorkerSlot) -> None:
        """Reads one decode worker's stream of event batches for as long as this backend runs
        and hands each event to its request's queue. When the worker dies, its requests get
        _LOST (they move on to another worker); once it is back, the stream is opened again."""
        while not self._closed.is_set():
            with self._changed:
                while not slot.up and not self._closed.is_set():
                    self._changed.wait(1.0)
            if self._closed.is_set():
                return
            try:
                for ref in slot.actor.events.remote(self._subscriber):
                    for request_id, event in ray.get(ref):
                        inbox = self._inboxes.get(request_id)
                        if inbox is not None:  # else cancelled and forgotten here
                            inbox.put(event)
                reason = "its events stream ended"
            except RayActorError as exc:
                reason = type(exc).__name__
            except Exception as exc:  # noqa: BLE001 - must not end the reader; retried
                reason = f"its events stream failed: {exc}"
            if self._closed.is_set():
                return
            # Out of routing until its `ready` answers again; then the stream is reopened.
            self._mark_down(slot, reason)
            with self._lock:  # its requests' events are gone: they go on elsewhere
                lost = [self._inboxes[request_id] for request_id, worker in self._workers.items()
                        if worker is slot and request_id in self._inboxes]
            for inbox in lost:
                inbox.put(_LOST)
            self._closed.wait(0.5)

    def _ended_before(self, handle: RequestHandle, request: GenerateRequest,
                      progress: _Progress) -> bool:
        """A worker that died after the answer's last token and before its end: ends the
        stream here (EOS or max_tokens reached) and returns True; else False."""
        tokens = progress.token_ids
        reason = end_reason(tokens[-1], len(tokens), request, self._eos_token_ids) \
            if tokens else None
        if reason is None:
            return False
        handle.events.put(StreamEvent([], "", totals=request_totals(
            handle, len(tokens), reason, time.perf_counter())))
        return True


def _pin(resource: str | None) -> dict[str, float]:
    """One unit of a custom resource, which only the nodes of one group advertise."""
    return {resource: 1} if resource else {}
