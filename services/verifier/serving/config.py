"""Configuration of the Generate API server and of its Ray workers: frozen, built once.

Torch-free and Ray-free, so CLIs build and validate configurations before loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sssd.common.config.flags import option
from sssd.common.rpc.ports import GENERATE_PORT, HTTP_PORT, RAY_DASHBOARD_PORT, RAY_METRICS_PORT
from sssd.verifier.engine.config import EngineConfig

if TYPE_CHECKING:
    from sssd.common.conversations.publisher import PublishConfig

AUTH_MODES = ("disabled", "token")


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class RayConfig:
    """Prefill/decode workers on Ray (ray_backend.py); auth is explained in ray_auth.py."""

    # Unset counts: on CPUs 1 decode worker, and 1 prefill worker from 4 CPUs on (below, the
    # decode worker prefills); with GPUs one worker per GPU (serving/placement.py).
    num_prefill_workers: int | None = option(
        None, "Ray actors that prefill prompts; 0: each decode worker prefills its own, inside "
        "its decode steps; unset: 1, or 0 on a CPU cluster of fewer than 4 CPUs",
        flag="--prefill-workers")
    num_decode_workers: int | None = option(
        None, "Ray actors that decode (engine loops); unset: 1, or on GPUs one per GPU left "
        "after the prefill workers", flag="--decode-workers")
    gpus_per_worker: float | None = option(
        None, "GPUs each prefill and decode worker reserves in Ray (at most 1: a worker runs "
        "the model on one GPU); unset: 1 when the engine's device is cuda, or auto on a cluster "
        "with GPUs, shared evenly where workers outnumber GPUs; 0 GPUs on CPUs")
    address: str | None = option(
        None, "join this Ray cluster (auto, host:port) instead of starting a local one",
        flag="--ray-address")
    auth: str = option("token", "Ray token authentication: token, or disabled (allowed on "
                       "loopback only)", choices=AUTH_MODES, flag="--ray-auth")
    auth_token: str | None = None  # a secret, so no flag: RAY_AUTH_TOKEN instead
    token_file: str | None = None  # a generated token is written here (0600)
    host: str = "127.0.0.1"  # where a local cluster binds (node, dashboard)
    dashboard_port: int = option(RAY_DASHBOARD_PORT, "the local Ray dashboard; 0: none")
    metrics_port: int = option(RAY_METRICS_PORT,
                               "the local Ray node's Prometheus endpoint (worker metrics)")
    num_cpus: int | None = None  # logical CPUs of a local cluster; None: os.cpu_count()
    cpus_per_worker: float = option(1.0, "logical CPUs each worker actor reserves in Ray")
    # Per worker; None: the node's cores split among the workers (threads that contend for the
    # same cores make every worker slower; bench/results/2026-11-28-epyc-2).
    torch_threads: int | None = option(None, "torch threads per worker; unset: the node's "
                                       "cores split among the workers")
    # Custom Ray resources (one unit per actor) that pin the workers to their node groups: on
    # Kubernetes the chart's prefill and decode worker groups advertise them (rayStartParams).
    prefill_resource: str | None = option(
        None, "custom Ray resource each prefill worker needs (a node group that advertises it)")
    decode_resource: str | None = option(
        None, "custom Ray resource each decode worker needs (a node group that advertises it)")
    # Failover: a worker that dies is restarted by Ray (reloading the model) while its
    # requests go on elsewhere; see ray_backend.py.
    max_worker_restarts: int = option(
        10, "times Ray restarts a prefill or decode worker that died; -1: without limit")
    max_failovers: int = option(
        3, "times one request moves on to another worker after a worker died; then INTERNAL")
    failover_wait_s: float = option(
        120.0, "how long a request waits for a live worker when all of a kind are down")
    object_store_bytes: int = 1 << 30  # a local cluster's object store (holds KV in flight)
    metrics_report_interval_ms: int = 2000

    def __post_init__(self) -> None:
        if self.num_prefill_workers is not None and self.num_prefill_workers < 0:
            raise ValueError(f"need 0 or more prefill workers, got {self.num_prefill_workers}")
        if self.num_decode_workers is not None and self.num_decode_workers < 1:
            raise ValueError(f"need at least one decode worker, got {self.num_decode_workers}")
        if self.gpus_per_worker is not None and not 0 < self.gpus_per_worker <= 1:
            raise ValueError(f"gpus_per_worker must be in (0, 1] (a worker runs the model on "
                             f"one GPU), got {self.gpus_per_worker}")
        if self.max_worker_restarts < -1 or self.max_failovers < 0 or self.failover_wait_s < 0:
            raise ValueError("need max_worker_restarts >= -1, max_failovers >= 0 and "
                             "failover_wait_s >= 0")
        if self.auth not in AUTH_MODES:
            raise ValueError(f"auth must be one of {AUTH_MODES}, got {self.auth!r}")
        if self.auth == "disabled" and self.address is None and not is_loopback(self.host):
            raise ValueError(f"auth 'disabled' is allowed only on loopback; {self.host!r} is "
                             "reachable from other machines: use auth 'token'")


@dataclass(frozen=True)
class FrontendConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = option("127.0.0.1", "address the Generate API binds")
    port: int = option(GENERATE_PORT, "the Generate API's port; 0: the OS picks")
    http: bool = option(True, "serve the OpenAI-compatible HTTP API beside gRPC (--no-http: "
                        "gRPC only)")
    http_port: int = option(HTTP_PORT, "the OpenAI-compatible HTTP API's port (same address "
                            "as the Generate API); 0: the OS picks")
    served_model_name: str | None = option(
        None, "the model's name in the HTTP API (`model` field, /v1/models); unset: the model "
        "file's name")
    max_requests: int = option(64, "running + queued requests; beyond it RESOURCE_EXHAUSTED")
    max_tokens_limit: int | None = option(
        None, "largest max_tokens a request may ask for; unset: what the context window holds "
        "beside one token of prompt")
    default_max_tokens: int = option(256, "max_tokens of a request that leaves it 0")
    grace_s: float = option(10.0, "on SIGTERM running requests get this long to finish")
    # A secret, so no flag of its own here: --api-key / --api-key-file / SSSD_API_KEY
    # (common/rpc/api_key.py). None: both APIs are open.
    api_key: str | None = None
    open_health: bool = option(
        True, "with an API key, HTTP /health and /metrics still answer without it (probes, "
        "Prometheus); --no-open-health: they need the key too")
    max_workers: int = 80  # gRPC handler threads (> max_requests, so refusals are answered)
    ray: RayConfig | None = None  # None: single process; else prefill/decode Ray workers
    # Completed conversations to the Redis stream of the live datastore (None: not published).
    publish: "PublishConfig | None" = None

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1 or (self.max_tokens_limit is not None and
                                           self.default_max_tokens > self.max_tokens_limit):
            raise ValueError("need 1 <= default_max_tokens <= max_tokens_limit")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http and self.http_port and self.http_port == self.port:
            raise ValueError(f"the HTTP API and the Generate API cannot share port {self.port}")
        if self.max_requests < 1 or self.max_workers <= self.max_requests:
            raise ValueError("need max_requests >= 1 and max_workers > max_requests")
