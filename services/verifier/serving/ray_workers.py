"""The verifier's Ray actors: prefill workers and decode workers (docs/services/verifier.md).

A prefill worker runs a prompt through the model in its own one-slot KV cache and returns the
prompt's keys and values as numpy arrays (engine/handoff.py), which Ray puts in its object
store. A decode worker is an `EngineLoop` (continuous batching with speculation) inside a
threaded actor. `submit` hands it a request; `events` is a Ray streaming generator, one per
frontend (its subscriber id), that yields the events of all that frontend's requests in
batches, one per engine step. Every batch is a Ray object, a thread wake-up in both processes
and a message, and the work of sending it takes the cores from the decode step's threads: a
stream per request, as before, sent one per request per step, and on 2 cores serving SmolLM2 at
8 concurrent requests one stream per worker serves about a tenth more tokens per second
(docs/services/verifier.md). `RayBackend` (ray_backend.py) creates the actors and routes
requests.

The classes are plain Python: `ray.remote(...)` turns them into actors where they are created,
so this module imports Ray nowhere.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from sssd.common.model.loader import load_causal_lm
from sssd.common.model.threads import off_main_thread
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.engine.handoff import PrefilledPrompt
from sssd.verifier.engine.request import GenerateRequest, InvalidRequest
from sssd.verifier.serving.backend import EngineGauges, StreamEvent
from sssd.verifier.serving.errors import ErrorKind, ServingError, StreamError
from sssd.verifier.serving.metrics import PrefillMetrics

# Cancels remembered for requests whose submit call has not arrived yet.
MAX_EARLY_CANCELS = 4096

# How long an `events` stream waits for events before it looks whether the worker is closing.
EVENTS_POLL_S = 1.0


def _set_threads(num_threads: int) -> None:
    """Ray sets OMP_NUM_THREADS to an actor's CPU count; the configuration decides instead."""
    import torch  # the driver imports this module to name the actors; only workers need torch

    torch.set_num_threads(num_threads)


class _ModelWorker:
    """What every worker does first: its torch threads, then its own copy of the model."""

    def __init__(self, config: EngineConfig, name: str, torch_threads: int):
        _set_threads(torch_threads)
        self.config = config = on_granted_gpu(config)
        # Off the actor's main thread: only the thread that runs the model keeps OpenMP workers.
        self.loaded = off_main_thread(lambda: load_causal_lm(config.model, config.dtype,
                                                             config.device))
        self.name = name

    def ready(self) -> dict:
        import torch  # in the worker (see _set_threads)

        return {"name": self.name, "pid": os.getpid(), "vocab_size": self.loaded.vocab_size,
                "fingerprint": self.loaded.fingerprint, "torch_threads": torch.get_num_threads(),
                "device": self.loaded.device}


def on_granted_gpu(config: EngineConfig) -> EngineConfig:
    """The worker's engine configuration: Ray shows an actor only the GPUs it granted
    (CUDA_VISIBLE_DEVICES), so a worker given a GPU runs on `cuda`, whatever index the
    setting named; one given none keeps the setting (auto: the CPU)."""
    import ray  # in the worker: see the module docstring

    if ray.get_gpu_ids():
        return replace(config, device="cuda")
    return config


def decode_worker_profile(profile_path: str | None, own_prefill: bool = False) -> str | None:
    """A decode worker's own forward profile beside `profile_path` (forward.json ->
    forward.ray-decode.json, or forward.ray-decode-own-prefill.json for a worker that prefills
    its own prompts): its steps run beside a prefill worker and the Ray processes on the same
    cores (several times slower on 2 cores than in a server without Ray), or alone on all of
    them, so a profile of one deployment must not price another's budgets."""
    if not profile_path:
        return profile_path
    path = Path(profile_path)
    kind = "ray-decode-own-prefill" if own_prefill else "ray-decode"
    return str(path.with_name(f"{path.stem}.{kind}{path.suffix}"))


class PrefillWorker(_ModelWorker):
    """Runs prompts through the model and hands their KV cache over (one prompt at a time).

    Its KV cache is a prefix cache: a prompt takes the blocks of the longest prefix an earlier
    prompt computed (a system prompt, a conversation's earlier turns) and computes the rest;
    the whole prompt's keys and values still travel to the decode worker."""

    def __init__(self, config: EngineConfig, name: str, torch_threads: int = 1,
                 metrics: bool = True) -> None:
        from sssd.verifier.engine.block_manager import BlockManager  # torch: workers only
        from sssd.verifier.factory import build_runner

        super().__init__(config, name, torch_threads)
        self.runner = build_runner(self.config, self.loaded)
        self.blocks = BlockManager(self.runner.cache.num_blocks, self.runner.block_size,
                                   self.runner.prefix_salt, self.config.enable_prefix_caching)
        self.metrics = None
        if metrics:
            self.metrics = PrefillMetrics(name)

    def ready(self) -> dict:
        from sssd.verifier.engine.scheduler import CHUNK_PADDING

        cache_positions = self.blocks.num_blocks * self.blocks.block_size
        return {**super().ready(),
                "context_window": min(self.runner.max_len, cache_positions - CHUNK_PADDING)}

    def prefill(self, prompt_ids: tuple[int, ...]) -> PrefilledPrompt:
        from sssd.verifier.engine.scheduler import CHUNK_PADDING

        table = self.blocks.admit(prompt_ids)
        try:
            if not self.blocks.ensure(table, len(prompt_ids) + CHUNK_PADDING):
                raise ValueError(f"a prompt of {len(prompt_ids)} tokens does not fit this "
                                 f"prefill worker's KV cache of {self.blocks.num_blocks} blocks")
            self.blocks.record_lookup(len(prompt_ids), table.num_cached)
            prefilled = self.runner.prefill_for_handoff(prompt_ids, table.blocks,
                                                        table.num_cached)
            self.blocks.register_full(table, len(prompt_ids), lambda p: prompt_ids[p:])
        finally:
            self.blocks.release(table)
        if self.metrics is not None:
            self.metrics.record(len(prompt_ids), prefilled.prefill_s, prefilled.num_cached_tokens)
        return prefilled


class DecodeWorker(_ModelWorker):
    """An engine loop (continuous batching with speculation) serving prefilled requests, or,
    with `own_prefill` (a deployment without prefill workers), requests whose prompts it
    prefills inside its decode steps."""

    def __init__(self, config: EngineConfig, name: str, max_requests: int,
                 torch_threads: int = 1, metrics: bool = True, publish=None,
                 own_prefill: bool = False) -> None:
        from sssd.verifier.serving.assembly import build_engine_loop  # torch: workers only

        super().__init__(config, name, torch_threads)
        self.config = replace(self.config, profile_path=decode_worker_profile(
            self.config.profile_path, own_prefill))
        # `publish`: completed conversations to the live datastore's stream.
        self.loop = off_main_thread(lambda: build_engine_loop(
            self.config, self.loaded, max_requests, publish=publish, worker=name,
            ray_metrics=metrics))
        # Cancels that arrived before their submit call (both race on the actor's threads).
        self._early_cancels: OrderedDict[str, None] = OrderedDict()
        self._outboxes: dict[str, Outbox] = {}  # subscriber id -> its requests' events
        self._closing = threading.Event()
        self._lock = threading.Lock()

    def ready(self) -> dict:
        return {**super().ready(), "sources": self.loop.limits.sources,
                "eos_token_ids": tuple(self.loaded.eos_token_ids),
                "context_window": self.loop.limits.context_window}

    def submit(self, request_id: str, request: GenerateRequest,
               prefilled: PrefilledPrompt | None, subscriber: str) -> StreamError | None:
        """Starts the request; its events go to `subscriber`'s `events` stream. `prefilled`:
        the prompt's KV from a prefill worker; None: the engine prefills it here. Returns the
        error that refused it, CANCELLED_BEFORE_SUBMIT when its cancel came first, else None."""
        outbox = self._outbox(subscriber)
        with self._lock:  # held across submit, so a cancel either sees the request or is early
            if self._early_cancels.pop(request_id, 0) is None:
                return CANCELLED_BEFORE_SUBMIT
            try:
                self.loop.submit(request, request_id=request_id, prefilled=prefilled,
                                 events=outbox.for_request(request_id))
            except InvalidRequest as exc:
                return StreamError(ErrorKind.INVALID_ARGUMENT, str(exc))
            except ServingError as exc:
                return StreamError(exc.kind, str(exc))
            except ValueError as exc:  # a prefilled KV this worker's model cannot take
                return StreamError(ErrorKind.INTERNAL, str(exc))
        return None

    def events(self, subscriber: str) -> Iterator[list[tuple[str, StreamEvent]]]:
        """The events of `subscriber`'s requests as (request id, event) batches, in the order
        the loop produced them, until the worker closes."""
        outbox = self._outbox(subscriber)
        while True:
            closing = self._closing.is_set()  # then the loop has ended every request
            batch = outbox.take(0.0 if closing else EVENTS_POLL_S)
            if batch:
                yield batch
            if closing:
                return

    def _outbox(self, subscriber: str) -> "Outbox":
        with self._lock:
            return self._outboxes.setdefault(subscriber, Outbox())

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if not self.loop.has_request(request_id):
                self._early_cancels[request_id] = None
                while len(self._early_cancels) > MAX_EARLY_CANCELS:
                    self._early_cancels.popitem(last=False)
                return
        self.loop.cancel(request_id)

    def num_requests(self) -> int:
        return self.loop.num_requests

    def engine_gauges(self) -> EngineGauges:
        return self.loop.engine_gauges()

    def drain(self) -> None:
        self.loop.drain()

    def close(self) -> None:
        self.loop.close()  # ends every open request with an error event
        self._closing.set()


# `DecodeWorker.submit`'s answer for a request cancelled before it arrived.
CANCELLED_BEFORE_SUBMIT = StreamError(ErrorKind.STOPPED, "cancelled before it started")


class Outbox:
    """One subscriber's events, collected until its `events` stream takes them."""

    def __init__(self) -> None:
        self._items: list[tuple[str, StreamEvent]] = []
        self._cond = threading.Condition()

    def put(self, request_id: str, event: StreamEvent) -> None:
        with self._cond:
            self._items.append((request_id, event))
            if len(self._items) == 1:  # the stream waits only while there is nothing
                self._cond.notify()

    def take(self, timeout: float) -> list[tuple[str, StreamEvent]]:
        """Everything collected so far, after waiting up to `timeout` s for a first event."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            items, self._items = self._items, []
        return items

    def for_request(self, request_id: str) -> "_RequestEvents":
        return _RequestEvents(self, request_id)


@dataclass(frozen=True)
class _RequestEvents:
    """Where the engine loop puts one request's events (RequestHandle.events): its outbox."""

    outbox: Outbox
    request_id: str

    def put(self, event: StreamEvent) -> None:
        self.outbox.put(self.request_id, event)
