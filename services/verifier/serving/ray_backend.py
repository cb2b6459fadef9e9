"""Prefill/decode disaggregation on Ray (DESIGN.md sections 3 and 9).

    frontend (gRPC, this process)
      |  1. prefill.prefill(prompt_ids)  -> ObjectRef[PrefilledPrompt]   (prefill worker)
      |  2. decode.generate(id, request, that ref) -> stream of StreamEvent  (decode worker)
      v
    the client's stream

The frontend passes the prefill's ObjectRef, not the data, to a decode worker, so the KV goes
from the prefill worker's store straight to the decode worker (on the same node it is read in
place, zero-copy) and is copied once, into the decode worker's cache slot (ray_workers.py).

`RayBackend` implements the `Backend` protocol (backend.py), so the gRPC frontend serves it
like the single-process engine loop: the same `Admission` control, then each request goes to
the least-loaded prefill and decode workers. Starting or joining the cluster: ray_auth.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace

from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.engine.request import GenerateRequest, RequestLimits
from sssd.verifier.serving.backend import Admission, RequestHandle, StreamEvent
from sssd.verifier.serving.config import RayConfig
from sssd.verifier.serving.errors import ErrorKind, StreamError
from sssd.verifier.serving.ray_auth import init_ray
from sssd.verifier.serving.ray_workers import DecodeWorker, PrefillWorker

logger = logging.getLogger(__name__)


@dataclass
class _Slot:
    actor: object  # a Ray actor handle
    load: int = 0  # requests in flight


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
        self._prefill: list[_Slot] = []
        self._decode: list[_Slot] = []
        self._workers: dict[str, _Slot] = {}  # request id -> its decode worker
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._owns_ray = False

    def start(self, timeout_s: float = 600.0) -> "RayBackend":
        """Starts or joins Ray, creates the workers and waits until each has loaded the model."""
        import ray

        if not ray.is_initialized():
            self.endpoints = init_ray(self.ray_config)
            self._owns_ray = True
        cfg = self.ray_config
        num_workers = cfg.num_prefill_workers + cfg.num_decode_workers
        threads = cfg.torch_threads or max(1, (os.cpu_count() or 1) // num_workers)
        options = dict(num_cpus=cfg.cpus_per_worker)
        prefill_cls = ray.remote(PrefillWorker).options(**options, resources=_pin(
            cfg.prefill_resource))
        # Threads: one per open stream, plus room for cancel and ready calls.
        decode_cls = ray.remote(DecodeWorker).options(
            max_concurrency=self.max_requests + 8, **options,
            resources=_pin(cfg.decode_resource))
        self._prefill = [_Slot(prefill_cls.remote(self.engine_config, f"prefill-{i}",
                                                  threads))
                         for i in range(cfg.num_prefill_workers)]
        self._decode = [_Slot(decode_cls.remote(self.engine_config, f"decode-{i}",
                                                self.max_requests, threads,
                                                publish=self.publish))
                        for i in range(cfg.num_decode_workers)]
        infos = ray.get([s.actor.ready.remote() for s in self._prefill + self._decode],
                        timeout=timeout_s)
        fingerprints = {info["fingerprint"] for info in infos}
        if len(fingerprints) != 1:
            raise RuntimeError(f"workers loaded models with different tokenizers: {infos}")
        # Every decode worker is built from the one engine config, so they offer the same
        # drafting sources; a request naming another is refused here, before any prefill.
        sources = infos[len(self._prefill)]["sources"]
        limits = RequestLimits.for_context(infos[0]["vocab_size"], self.engine_config.max_len,
                                           sources)
        self.admission = Admission(self.max_requests, limits)
        logger.info("Ray workers ready: %s", ", ".join(
            f"{i['name']} (pid {i['pid']}, {i['torch_threads']} torch threads)" for i in infos))
        return self

    # --- the Backend protocol ---------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        return self._started().limits

    def submit(self, request: GenerateRequest) -> RequestHandle:
        handle = self._started().admit(request)
        with self._lock:
            prefill = min(self._prefill, key=lambda s: s.load)
            decode = min(self._decode, key=lambda s: s.load)
            prefill.load += 1
            decode.load += 1
        threading.Thread(target=self._pump, args=(handle, request, prefill, decode),
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

    def close(self, timeout: float = 10.0) -> None:
        """Closes the decode workers' loops, ends the workers and a Ray cluster started here."""
        import ray

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

    # --- one request ----------------------------------------------------------------------------

    def _pump(self, handle: RequestHandle, request: GenerateRequest, prefill: _Slot,
              decode: _Slot) -> None:
        """Prefill, handoff and decode of one request; its events go to handle.events."""
        import ray

        request_id = handle.request_id
        released_prefill = False
        try:
            kv_ref = prefill.actor.prefill.remote(request.prompt_ids)
            with self._lock:
                self._workers[request_id] = decode
                cancelled = request_id in self._cancelled
            if cancelled:
                return
            stream = decode.actor.generate.remote(request_id, request, kv_ref)
            for ref in stream:
                event: StreamEvent = ray.get(ref)
                if not released_prefill:  # the prefill is done once the stream has started
                    released_prefill = True
                    with self._lock:
                        prefill.load -= 1
                now = time.perf_counter()
                if event.token_ids and handle.first_token_at is None:
                    handle.first_token_at = now
                if event.totals is not None:  # timed here: includes the transfers
                    first = handle.first_token_at or now
                    event = replace(event, totals=replace(
                        event.totals, time_to_first_token_s=first - handle.arrival,
                        total_s=now - handle.arrival))
                handle.events.put(event)
                if event.totals is not None or event.error is not None:
                    return
            if request_id not in self._cancelled:
                handle.events.put(StreamEvent([], "", error=StreamError(
                    ErrorKind.INTERNAL, "the decode worker ended the stream without a result")))
        except Exception as exc:  # noqa: BLE001 - a worker died or failed: fail this request
            logger.warning("request %s failed in a worker: %s", request_id, exc)
            handle.events.put(StreamEvent([], "", error=StreamError(
                ErrorKind.INTERNAL, f"worker failure: {exc}")))
        finally:
            self.admission.release(request_id)
            with self._lock:
                self._workers.pop(request_id, None)
                self._cancelled.discard(request_id)
                decode.load -= 1
                if not released_prefill:
                    prefill.load -= 1
            handle.done = True


def _pin(resource: str | None) -> dict[str, float]:
    """One unit of a custom resource, which only the nodes of one group advertise."""
    return {resource: 1} if resource else {}
