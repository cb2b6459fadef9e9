"""Prefill/decode disaggregation on Ray (DESIGN.md sections 3 and 9).

    frontend (gRPC, this process)
      |  1. prefill.prefill(prompt_ids)  -> ObjectRef[PrefilledPrompt]   (prefill worker)
      |  2. decode.generate(id, request, that ref) -> stream of StreamEvent  (decode worker)
      v
    the client's stream

A prefill worker runs the prompt through the model in its own one-slot KV cache and returns the
prompt's keys and values as numpy arrays (handoff.py); they go into Ray's object store. The
frontend passes the ObjectRef, not the data, to a decode worker, so the KV goes from the prefill
worker's store straight to the decode worker (on the same node it is read in place, zero-copy)
and is copied once, into the decode worker's cache slot. A decode worker is an `EngineLoop`
(continuous batching with speculation) inside a threaded actor; `generate` is a Ray streaming
generator that yields the request's events as the loop produces them.

`RayBackend` has the engine loop's interface (submit, cancel, drain, stop), so the gRPC frontend
serves either one. It enforces the concurrency limit itself and sends each request to the
least-loaded prefill and decode workers.

Authentication: Ray 2.59+ turns token authentication on by default for a new local cluster, and
this deployment keeps it on by default (`RayConfig.auth = "token"`): Ray's GCS, raylet and
object-manager ports listen on every interface even when the node address is 127.0.0.1 (checked
with `ss -ltnp` on Ray 2.60), so a cluster without auth is open to anyone who can reach the
machine. The token is `auth_token`, else RAY_AUTH_TOKEN, else, for a new local cluster, a fresh
random one (written to `token_file` when set, mode 0600, for the dashboard's login); joining a
cluster (`address`) without one leaves it to Ray (RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token).
`auth = "disabled"` is an explicit opt-out for machines whose network is closed otherwise; it is
refused when `host` is not a loopback address. The Prometheus endpoint needs no token.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, replace

from sssd.verifier.config import EngineConfig
from sssd.verifier.handoff import PrefilledPrompt
from sssd.verifier.loop import Draining, Overloaded, RequestHandle, StreamEvent
from sssd.verifier.sampling import SamplingParams

logger = logging.getLogger(__name__)

AUTH_MODES = ("disabled", "token")
NAMESPACE = "sssd"


@dataclass(frozen=True)
class RayConfig:
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    # None: start a local cluster in this process; "auto" or "host:port": join a running one.
    address: str | None = None
    auth: str = "token"  # or "disabled"; see the module docstring
    auth_token: str | None = None
    token_file: str | None = None  # a generated token is written here (0600)
    host: str = "127.0.0.1"  # where a local cluster binds (node, dashboard)
    dashboard_port: int = 8265  # 0: no dashboard
    metrics_port: int = 8080  # the local node's Prometheus endpoint
    num_cpus: int | None = None  # logical CPUs of a local cluster; None: os.cpu_count()
    cpus_per_worker: float = 1.0  # Ray scheduling resource per worker actor
    # Per worker; None: the node's cores split among the workers (on the 2-core machines one
    # thread each measured 18 tokens/s against 14-15 with two threads that contend).
    torch_threads: int | None = None
    object_store_bytes: int = 1 << 30  # a local cluster's object store (holds KV in flight)
    metrics_report_interval_ms: int = 2000

    def __post_init__(self) -> None:
        if self.num_prefill_workers < 1 or self.num_decode_workers < 1:
            raise ValueError("need at least one prefill worker and one decode worker")
        if self.auth not in AUTH_MODES:
            raise ValueError(f"auth must be one of {AUTH_MODES}, got {self.auth!r}")
        if self.auth == "disabled" and self.address is None and not is_loopback(self.host):
            raise ValueError(f"auth 'disabled' is allowed only on loopback; {self.host!r} is "
                             "reachable from other machines: use auth 'token'")


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


# --- the workers (Ray actors) -----------------------------------------------------------------


def _set_threads(num_threads: int) -> None:
    """Ray sets OMP_NUM_THREADS to an actor's CPU count; the configuration decides instead."""
    import torch

    torch.set_num_threads(num_threads)


class _ModelWorker:
    """What every worker does first: its torch threads, then its own copy of the model."""

    def __init__(self, config: EngineConfig, name: str, torch_threads: int):
        from sssd.common.model_loader import load_causal_lm

        _set_threads(torch_threads)
        self.loaded = load_causal_lm(config.model, config.dtype)
        self.name = name

    def ready(self) -> dict:
        import torch

        return {"name": self.name, "pid": os.getpid(), "vocab_size": self.loaded.vocab_size,
                "fingerprint": self.loaded.fingerprint, "torch_threads": torch.get_num_threads()}


class PrefillWorker(_ModelWorker):
    """Runs prompts through the model and hands their KV cache over (one prompt at a time)."""

    def __init__(self, config: EngineConfig, name: str, torch_threads: int = 1,
                 metrics: bool = True) -> None:
        from sssd.verifier.model_runner import ModelRunner

        super().__init__(config, name, torch_threads)
        self.runner = ModelRunner(self.loaded.model, max_seqs=1, max_len=config.max_len)
        self.metrics = None
        if metrics:
            from sssd.verifier.metrics import PrefillMetrics

            self.metrics = PrefillMetrics(name)

    def prefill(self, prompt_ids: list[int]) -> PrefilledPrompt:
        prefilled = self.runner.prefill_for_handoff(prompt_ids)
        if self.metrics is not None:
            self.metrics.record(len(prompt_ids), prefilled.prefill_s)
        return prefilled


class DecodeWorker(_ModelWorker):
    """An engine loop (continuous batching with speculation) serving prefilled requests."""

    def __init__(self, config: EngineConfig, name: str, max_requests: int,
                 torch_threads: int = 1, metrics: bool = True, publish=None) -> None:
        from sssd.verifier.factory import build_engine_loop

        super().__init__(config, name, torch_threads)
        # `publish`: completed conversations to the live datastore's stream.
        self.loop = build_engine_loop(config, self.loaded, max_requests, publish=publish,
                                      worker=name, ray_metrics=metrics)
        # Cancels that arrived before their generate call (both race on the actor's threads).
        self._early_cancels: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def generate(self, request_id: str, request: dict,
                 prefilled: PrefilledPrompt) -> Iterator[StreamEvent]:
        """Streams the request's events; the last one has totals or an error."""
        with self._lock:  # held across submit, so a cancel either sees the request or is early
            if self._early_cancels.pop(request_id, 0) is None:
                return
            try:
                handle = self.loop.submit(request_id=request_id, prefilled=prefilled, **request)
            except (Overloaded, Draining, ValueError) as exc:
                error = str(exc)
            else:
                error = None
        if error is not None:
            yield StreamEvent([], "", error=error)
            return
        while True:
            event = handle.events.get()
            yield event
            if event.totals is not None or event.error is not None:
                return

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if not self.loop.has_request(request_id):
                self._early_cancels[request_id] = None
                while len(self._early_cancels) > 4096:
                    self._early_cancels.popitem(last=False)
                return
        self.loop.cancel(request_id)

    def num_requests(self) -> int:
        return self.loop.num_requests

    def drain(self) -> None:
        self.loop.drain()

    def close(self) -> None:
        self.loop.close()


# --- the frontend's side --------------------------------------------------------------------


def configure_auth(config: RayConfig) -> str | None:
    """Sets Ray's auth variables for this process and its children; returns the file a newly
    generated token was written to, if any."""
    os.environ["RAY_AUTH_MODE"] = config.auth
    if config.auth == "disabled":
        os.environ.pop("RAY_AUTH_TOKEN", None)
        _reload_ray_auth()
        logger.warning("Ray token authentication is disabled: Ray's ports listen on every "
                       "interface, so only do this on a machine whose network is closed")
        return None
    token = config.auth_token or os.environ.get("RAY_AUTH_TOKEN")
    written = None
    if not token and config.address is None:
        token = secrets.token_hex(32)
        if config.token_file:
            path = os.path.abspath(config.token_file)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as f:
                f.write(token + "\n")
            written = path
    if token:
        os.environ["RAY_AUTH_TOKEN"] = token
    _reload_ray_auth()
    return written


def _reload_ray_auth() -> None:
    """Ray reads RAY_AUTH_MODE and the token once, when its core is first used in a process;
    make an already imported Ray see the values just set (the same refresh Ray does when it
    turns token auth on itself)."""
    import ray._raylet as raylet

    raylet.Config.initialize("")
    raylet.AuthenticationTokenLoader.instance().reset_cache()


def init_ray(config: RayConfig) -> dict:
    """Starts a local Ray cluster (or joins `config.address`) with the configured auth mode;
    returns where its dashboard and Prometheus endpoint are."""
    import ray

    token_file = configure_auth(config)
    if config.address is not None:
        context = ray.init(address=config.address, namespace=NAMESPACE,
                           log_to_driver=False, configure_logging=False)
        return {"dashboard": context.dashboard_url, "metrics": None, "auth": config.auth}
    for attempt in (1, 2, 3):
        try:
            context = _init_local(config)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises bare Exceptions while starting
            # Seen here on Ray 2.60, each on the first start after another cluster had just
            # stopped: the raylet not registering within Ray's fixed 30 s, the dashboard's
            # process gone before it wrote its log. A fresh start right after works.
            if attempt == 3:
                raise
            logger.warning("the local Ray cluster did not start (%s); starting it again", exc)
            ray.shutdown()
            time.sleep(2.0)
    dashboard = f"http://{context.dashboard_url}" if context.dashboard_url else None
    return {"dashboard": dashboard, "auth": config.auth, "token_file": token_file,
            "metrics": f"http://{config.host}:{config.metrics_port}/metrics"}


def _init_local(config: RayConfig):
    import ray

    return ray.init(
        num_cpus=config.num_cpus or os.cpu_count() or 1,
        namespace=NAMESPACE,
        include_dashboard=config.dashboard_port > 0,
        dashboard_host=config.host,
        dashboard_port=config.dashboard_port or None,
        object_store_memory=config.object_store_bytes,
        _node_ip_address=config.host,
        _metrics_export_port=config.metrics_port,
        _system_config={"metrics_report_interval_ms": config.metrics_report_interval_ms},
        log_to_driver=False,
        configure_logging=False,
    )


@dataclass
class _Slot:
    actor: object
    load: int = 0  # requests in flight


class RayBackend:
    """The engine loop's interface over Ray prefill and decode workers."""

    def __init__(self, engine_config: EngineConfig, ray_config: RayConfig,
                 max_requests: int = 64, publish=None) -> None:
        self.engine_config = engine_config
        self.publish = publish  # PublishConfig of the live datastore, or None
        self.ray_config = ray_config
        self.max_requests = max_requests
        self.endpoints: dict = {}
        self.vocab_size = 0
        self._prefill: list[_Slot] = []
        self._decode: list[_Slot] = []
        self._handles: dict[str, RequestHandle] = {}
        self._workers: dict[str, _Slot] = {}  # request id -> its decode worker
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._draining = False
        self._ids = itertools.count()
        self._prefix = os.urandom(3).hex()
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
        prefill_cls = ray.remote(PrefillWorker).options(**options)
        # Threads: one per open stream, plus room for cancel and ready calls.
        decode_cls = ray.remote(DecodeWorker).options(
            max_concurrency=self.max_requests + 8, **options)
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
        self.vocab_size = infos[0]["vocab_size"]
        logger.info("Ray workers ready: %s", ", ".join(
            f"{i['name']} (pid {i['pid']}, {i['torch_threads']} torch threads)" for i in infos))
        return self

    # --- the engine loop's interface ---------------------------------------------------------

    def submit(self, prompt_ids: Seq[int], max_tokens: int, sampling: SamplingParams,
               stop: Seq[str] = (), speculate: bool = True) -> RequestHandle:
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self._handles) >= self.max_requests:
                raise Overloaded(f"the server holds its maximum of {self.max_requests} "
                                 "concurrent requests")
            handle = RequestHandle(f"r{self._prefix}-{next(self._ids)}", len(prompt_ids),
                                   time.perf_counter())
            self._handles[handle.request_id] = handle
            prefill = min(self._prefill, key=lambda s: s.load)
            decode = min(self._decode, key=lambda s: s.load)
            prefill.load += 1
            decode.load += 1
        request = dict(prompt_ids=list(prompt_ids), max_tokens=max_tokens, sampling=sampling,
                       stop=tuple(stop), speculate=speculate)
        threading.Thread(target=self._pump, args=(handle, request, prefill, decode),
                         name=f"pump-{handle.request_id}", daemon=True).start()
        return handle

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._handles or request_id in self._cancelled:
                return
            self._cancelled.add(request_id)
            decode = self._workers.get(request_id)
        if decode is not None:
            decode.actor.cancel.remote(request_id)

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._handles)

    def drain(self) -> None:
        with self._lock:
            self._draining = True
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

    # --- one request ----------------------------------------------------------------------------

    def _pump(self, handle: RequestHandle, request: dict, prefill: _Slot,
              decode: _Slot) -> None:
        """Prefill, handoff and decode of one request; its events go to handle.events."""
        import ray

        request_id = handle.request_id
        released_prefill = False
        try:
            kv_ref = prefill.actor.prefill.remote(request["prompt_ids"])
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
                handle.events.put(StreamEvent([], "", error="the decode worker ended the "
                                              "stream without a result"))
        except Exception as exc:  # noqa: BLE001 - a worker died or failed: fail this request
            logger.warning("request %s failed in a worker: %s", request_id, exc)
            handle.events.put(StreamEvent([], "", error=f"worker failure: {exc}"))
        finally:
            with self._lock:
                self._handles.pop(request_id, None)
                self._workers.pop(request_id, None)
                self._cancelled.discard(request_id)
                decode.load -= 1
                if not released_prefill:
                    prefill.load -= 1
            handle.done = True
