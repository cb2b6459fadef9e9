"""The speculator's gRPC service (proto/sssd/v1/speculator.proto) and its console script.

The servicer translates messages and maps the core's exceptions to status codes; validation and
state live in `Speculator`. `build_speculator` loads the draft model from `SpeculatorConfig`.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from concurrent import futures
from typing import TYPE_CHECKING, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sssd.common.config.logs import configure_logging
from sssd.common.model.device import resolve_device
from sssd.common.model.loader import load_causal_lm
from sssd.common.rpc import tls
from sssd.common.rpc.server import serve_until_signal
from sssd.common.rpc.status import call_or_abort
from sssd.common.rpc.targets import address
from sssd.speculator.config import SpeculatorConfig
from sssd.speculator.protocol import FingerprintMismatch, RoundInput
from sssd.speculator.runner import DraftRunner
from sssd.speculator.speculator import Speculator
from sssd.v1 import speculator_pb2, speculator_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = speculator_pb2.DESCRIPTOR.services_by_name["Speculator"].full_name
T = TypeVar("T")

if TYPE_CHECKING:
    from sssd.common.model.loader import LoadedModel


def truncated(model, num_layers: int):  # type: ignore[no-untyped-def]
    """A draft model made of `model`'s first `num_layers` decoder layers and its head, sharing
    their weights (no copy); `model` itself is unchanged."""
    base = model.base_model
    if not 1 <= num_layers <= len(base.layers):
        raise ValueError(f"draft_layers must be in [1, {len(base.layers)}], got {num_layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:num_layers]
    draft_base = copy.copy(base)
    draft_base._modules = dict(base._modules)
    draft_base.layers = torch.nn.ModuleList(list(base.layers)[:num_layers])
    draft_base.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    setattr(draft, model.base_model_prefix, draft_base)
    draft.config = config
    return draft


def build_speculator(config: SpeculatorConfig,
                     loaded: LoadedModel | None = None) -> Speculator:
    """Loads the draft model (or takes `loaded`) and builds the core."""

    if loaded is None:
        loaded = load_causal_lm(config.model, dtype=config.dtype)
    model = loaded.model
    if config.draft_layers:
        model = truncated(model, config.draft_layers)
    device = resolve_device(config.device)  # ValueError where the device is missing
    model = model.to(device)
    runner = DraftRunner(model, config.max_sequences, config.max_len, device, config.model_impl)
    speculator = Speculator(
        runner, vocab_size=loaded.vocab_size, fingerprint=loaded.fingerprint,
        lookahead=config.lookahead, fanout_budget=config.fanout_budget,
        fanout_kind=config.fanout, saguaro_c=config.saguaro_c,
        critical_batch_size=config.critical_batch_size, max_batch_size=config.max_batch_size,
        speculate_ahead=config.speculate_ahead, device=str(device),
        model_name=loaded.name + (f"[:{config.draft_layers} layers]" if config.draft_layers
                                  else ""))
    return speculator


class SpeculatorServicer(speculator_pb2_grpc.SpeculatorServicer):
    def __init__(self, speculator: Speculator) -> None:
        self._speculator = speculator

    def Round(self, request: speculator_pb2.RoundRequest,
              context: grpc.ServicerContext) -> speculator_pb2.RoundResponse:
        inputs = [RoundInput(seq_id=s.seq_id, token_ids=list(s.token_ids),
                             num_accepted=s.num_accepted, budget=s.budget, is_start=s.is_start,
                             temperature=s.temperature, seed=s.seed)
                  for s in request.sequences]
        outputs = _call(context, "Round", lambda: self._speculator.round(
            inputs, request.tokenizer_fingerprint or None))
        return speculator_pb2.RoundResponse(sequences=[
            speculator_pb2.SequenceDrafts(hit=o.hit, fallback=o.fallback, token_ids=o.token_ids,
                                          probs=o.probs) for o in outputs])

    def EndSequences(self, request: speculator_pb2.EndSpeculationRequest,
                     context: grpc.ServicerContext) -> speculator_pb2.EndSpeculationResponse:
        num = _call(context, "EndSequences", lambda: self._speculator.end(list(request.seq_ids)))
        return speculator_pb2.EndSpeculationResponse(num_ended=num)

    def GetInfo(self, request: speculator_pb2.SpeculatorInfoRequest,
                context: grpc.ServicerContext) -> speculator_pb2.SpeculatorInfo:
        return _call(context, "GetInfo", lambda: info_message(self._speculator))


def info_message(s: Speculator) -> speculator_pb2.SpeculatorInfo:
    stats = s.stats
    return speculator_pb2.SpeculatorInfo(
        model_name=s.model_name, tokenizer_fingerprint=s.fingerprint or "",
        vocab_size=s.vocab_size, lookahead=s.lookahead, fanout_budget=s.fanout_budget,
        fanout=s.fanout_kind, device=s.device,
        max_batch_size=s.max_batch_size, max_sequences=s.max_sequences,
        num_sequences=s.num_sequences, rounds=stats.rounds, hits=stats.hits,
        misses_jit=stats.misses_jit, misses_fallback=stats.misses_fallback,
        speculate_s=stats.speculate_s, wait_s=stats.wait_s,
        acceptance_rate=s.estimator.acceptance, miss_exponent=s.estimator.miss_exponent,
        critical_batch_size=s.critical_batch_size())


class SpeculatorCollector:
    """Prometheus metrics read from the speculator at scrape time (no update loop)."""

    def __init__(self, speculator: Speculator) -> None:
        self._speculator = speculator

    def collect(self):  # type: ignore[no-untyped-def]
        s = self._speculator
        stats = s.stats
        counters = [("rounds", "Round calls", stats.rounds),
                    ("sequence_rounds", "Sequences in Round calls", stats.rows),
                    ("hits", "Sequence rounds served from the speculation cache", stats.hits),
                    ("speculate_seconds", "Background speculation time", stats.speculate_s),
                    ("wait_seconds", "Time rounds waited for the speculation", stats.wait_s),
                    ("jit_seconds", "Just-in-time drafting time on misses", stats.jit_s)]
        for name, text, value in counters:
            yield CounterMetricFamily(f"sssd_speculator_{name}", text, value=value)
        misses = CounterMetricFamily("sssd_speculator_misses", "Cache misses by what drafted "
                                     "them", labels=["kind"])
        misses.add_metric(["jit"], stats.misses_jit)
        misses.add_metric(["fallback"], stats.misses_fallback)
        yield misses
        predicted = stats.hits + stats.misses_jit + stats.misses_fallback
        gauges = [("hit_rate", "Hits over sequence rounds that needed drafts",
                   stats.hits / predicted if predicted else 0.0),
                  ("acceptance_rate", "Online estimate of the acceptance rate a",
                   s.estimator.acceptance),
                  ("miss_exponent", "Online estimate of the miss exponent r",
                   s.estimator.miss_exponent),
                  ("critical_batch_size", "b*: largest batch drafting misses just in time",
                   s.critical_batch_size()),
                  ("sequences", "Live sequences", s.num_sequences)]
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"sssd_speculator_{name}", text, value=value)
        fanout = GaugeMetricFamily("sssd_speculator_fanout", "Predicted bonus tokens per "
                                   "outcome k at the current estimates", labels=["k"])
        for k, f in enumerate(s.current_fanout()):
            fanout.add_metric([str(k)], f)
        yield fanout


def start_metrics(speculator: Speculator, port: int) -> None:
    """Serves the speculator's metrics at http://127.0.0.1:port/metrics."""
    registry = CollectorRegistry()
    registry.register(SpeculatorCollector(speculator))
    start_http_server(port, addr="127.0.0.1", registry=registry)


# The speculator's own rows in front of the shared table: FingerprintMismatch is a ValueError.
_SPECULATOR_ERRORS = ((FingerprintMismatch, grpc.StatusCode.FAILED_PRECONDITION),
                      (ConnectionError, grpc.StatusCode.UNAVAILABLE))  # draining


def _call(context: grpc.ServicerContext, rpc: str, fn: Callable[[], T]) -> T:
    return call_or_abort(context, rpc, fn, "speculator", _SPECULATOR_ERRORS)


def create_server(config: SpeculatorConfig, speculator: Speculator
                  ) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Starts serving `speculator` on config.host:config.port (0: any free port); health
    reports SERVING once this returns. The caller closes the speculator after stopping."""
    server = grpc.server(futures.ThreadPoolExecutor(config.max_workers,
                                                    thread_name_prefix="speculator-rpc"))
    speculator_pb2_grpc.add_SpeculatorServicer_to_server(SpeculatorServicer(speculator), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = tls.bind(server, address(config.host, config.port))
    server.start()
    for service in (SERVICE_NAME, ""):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def serve(config: SpeculatorConfig) -> None:
    """Serves until SIGTERM or SIGINT; then NOT_SERVING, new rounds refused (UNAVAILABLE,
    callers decode without the speculator), in-flight calls drained for config.grace_s."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    speculator = build_speculator(config)
    server, port, health_servicer = create_server(config, speculator)
    if config.metrics_port:
        start_metrics(speculator, config.metrics_port)
    logger.info("speculator (%s on %s, K=%d, B=%d %s) listening on %s",
                speculator.model_name, speculator.device, config.lookahead,
                config.fanout_budget, config.fanout, address(config.host, port)
                + (f", metrics on 127.0.0.1:{config.metrics_port}/metrics"
                   if config.metrics_port else ""))
    try:
        serve_until_signal(server, health_servicer, config.grace_s, on_stop=speculator.drain)
    finally:
        speculator.close()
    logger.info("speculator stopped")


def main(argv: list[str] | None = None) -> None:
    """Console script `sssd-speculator`. Log level: SSSD_LOG_LEVEL (default INFO)."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    configure_logging("INFO")
    serve(SpeculatorConfig.from_args(argv))


if __name__ == "__main__":
    main()
