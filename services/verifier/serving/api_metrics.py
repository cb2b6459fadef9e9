"""Prometheus metrics of the requests this frontend answers (HTTP and gRPC alike), served on the
HTTP API's GET /metrics.

They are recorded from the events each request streams back, so they cover both backends (the
engine in this process and the Ray workers) the same way. Every series exists twice: under this
project's names (`sssd_api_*`) and under the names vLLM's server exports (`vllm:*`), so that
`vllm bench serve` (which reads `vllm:spec_decode_*` before and after a run to report acceptance)
and dashboards written for vLLM read this server unchanged.

Speculation is counted as vLLM counts it: a draft is one verification step of one sequence that
had draft tokens; its draft tokens are the tree's nodes but the root (for a tree they include
the siblings that cannot all be accepted, so the acceptance rate of a tree is lower than that of
a chain with the same accepted length); position p of a draft is accepted when the accepted path
is longer than p.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sssd.verifier.serving.backend import EngineGauges, StreamEvent

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds; the buckets vLLM uses for the same histograms (CPU steps are 10-200 ms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
MAX_POSITIONS = 64  # per-position acceptance is kept for the first positions of a draft
# No `*_created` series beside every counter (as vLLM's server does): half the text, no reader.
prometheus_client.disable_created_metrics()


class _Twin:
    """One series under both names: ours and vLLM's. Label values are passed in order."""

    def __init__(self, kind, registry: CollectorRegistry, ours: str, vllm: str, doc: str,
                 labels: tuple[str, ...], **kwargs) -> None:
        self.metrics = (kind(ours, doc, labels, registry=registry, **kwargs),
                        kind(vllm, doc, labels, registry=registry, **kwargs))

    def labels(self, *values: str) -> list:
        return [metric.labels(*values) for metric in self.metrics]


class ApiMetrics:
    """Thread-safe: gRPC handler threads and the HTTP event loop record into it."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        model = ("model_name",)
        self.running = Gauge("sssd_api_requests_running", "Requests admitted and not ended",
                             model, registry=registry)
        # The engines' own figures (Backend.engine_gauges), read when /metrics is asked for.
        self.gauges: Callable[[], EngineGauges | None] | None = None
        self.vllm_running = Gauge("vllm:num_requests_running",
                                  "Requests in the engines' running batches", model,
                                  registry=registry)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting",
                                  "Requests submitted and not yet in a running batch", model,
                                  registry=registry)
        self.kv_usage = _Twin(Gauge, registry, "sssd_api_kv_cache_usage_perc",
                              "vllm:kv_cache_usage_perc",
                              "Fraction of the KV cache's blocks held by requests (1: all)",
                              model)
        self.preemptions = _Twin(Counter, registry, "sssd_api_num_preemptions",
                                 "vllm:num_preemptions",
                                 "Requests preempted for want of KV blocks", model)
        self.prefix_queries = _Twin(Counter, registry, "sssd_api_prefix_cache_queries",
                                    "vllm:prefix_cache_queries",
                                    "Prompt tokens looked up in the prefix cache", model)
        self.prefix_hits = _Twin(Counter, registry, "sssd_api_prefix_cache_hits",
                                 "vllm:prefix_cache_hits",
                                 "Prompt tokens found in the prefix cache", model)
        self._num_preemptions = 0  # the engines' total at the last export
        self._num_open = 0  # requests tracked and not ended
        self._lock = threading.Lock()
        self.success = _Twin(Counter, registry, "sssd_api_request_success",
                             "vllm:request_success", "Requests that ended, by finish reason",
                             model + ("finished_reason",))
        self.refused = Counter("sssd_api_requests_refused", "Requests refused, by error kind",
                               model + ("kind",), registry=registry)
        self.prompt_tokens = _Twin(Counter, registry, "sssd_api_prompt_tokens",
                                   "vllm:prompt_tokens", "Prompt tokens of admitted requests",
                                   model)
        self.generation_tokens = _Twin(Counter, registry, "sssd_api_generation_tokens",
                                       "vllm:generation_tokens", "Tokens generated", model)
        self.ttft = _Twin(Histogram, registry, "sssd_api_time_to_first_token_seconds",
                          "vllm:time_to_first_token_seconds", "Time to first token", model,
                          buckets=TTFT_BUCKETS)
        self.itl = _Twin(Histogram, registry, "sssd_api_inter_token_latency_seconds",
                         "vllm:inter_token_latency_seconds",
                         "Time between tokens (a step that emits k tokens counts k gaps of 1/k "
                         "of its time)", model, buckets=ITL_BUCKETS)
        self.tpot = _Twin(Histogram, registry, "sssd_api_time_per_output_token_seconds",
                          "vllm:request_time_per_output_token_seconds",
                          "Per request: (end - first token) / (output tokens - 1)", model,
                          buckets=ITL_BUCKETS)
        self.e2e = _Twin(Histogram, registry, "sssd_api_e2e_request_latency_seconds",
                         "vllm:e2e_request_latency_seconds", "Request latency, arrival to end",
                         model, buckets=E2E_BUCKETS)
        self.drafts = _Twin(Counter, registry, "sssd_api_spec_decode_num_drafts",
                            "vllm:spec_decode_num_drafts",
                            "Verification steps of a sequence that had draft tokens", model)
        self.draft_tokens = _Twin(Counter, registry, "sssd_api_spec_decode_num_draft_tokens",
                                  "vllm:spec_decode_num_draft_tokens",
                                  "Draft tokens verified (tree nodes but the root)", model)
        self.accepted = _Twin(Counter, registry, "sssd_api_spec_decode_num_accepted_tokens",
                              "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                              model)
        self.accepted_per_pos = _Twin(Counter, registry,
                                      "sssd_api_spec_decode_num_accepted_tokens_per_pos",
                                      "vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose accepted path reached this position", model
                                      + ("position",))
        # Touch the speculation series so that they exist (at 0) before the first draft: a
        # client reading /metrics before and after a run sees both.
        for twin in (self.drafts, self.draft_tokens, self.accepted, self.preemptions,
                     self.prefix_queries, self.prefix_hits):
            twin.labels(model_name)

    def refused_request(self, kind: str) -> None:
        self.refused.labels(self.model_name, kind).inc()

    def track(self, num_prompt_tokens: int) -> "RequestTracker":
        """Call once a request is admitted; record its events into the tracker."""
        self.running.labels(self.model_name).inc()
        with self._lock:
            self._num_open += 1
        for counter in self.prompt_tokens.labels(self.model_name):
            counter.inc(num_prompt_tokens)
        return RequestTracker(self, num_prompt_tokens)

    def untrack(self) -> None:
        """A tracked request ended (RequestTracker.end)."""
        self.running.labels(self.model_name).dec()
        with self._lock:
            self._num_open -= 1

    def export(self) -> bytes:
        """The text exposition, the engines' gauges read first (they may block for a moment:
        a Ray backend asks its workers)."""
        self._read_gauges()
        return generate_latest(self.registry)

    def _read_gauges(self) -> None:
        gauges = self.gauges() if self.gauges is not None else None
        model = self.model_name
        if gauges is None:  # no engine to ask: the requests this frontend holds
            with self._lock:
                self.vllm_running.labels(model).set(self._num_open)
            self.vllm_waiting.labels(model).set(0)
            return
        self.vllm_running.labels(model).set(gauges.num_running)
        self.vllm_waiting.labels(model).set(gauges.num_waiting)
        for gauge in self.kv_usage.labels(model):
            gauge.set(gauges.kv_cache_usage)
        if gauges.num_preemptions > self._num_preemptions:
            for counter in self.preemptions.labels(model):
                counter.inc(gauges.num_preemptions - self._num_preemptions)
        self._num_preemptions = max(self._num_preemptions, gauges.num_preemptions)


class RequestTracker:
    """The metrics of one request, fed its stream events in order; `end` exactly once."""

    def __init__(self, metrics: ApiMetrics, num_prompt_tokens: int = 0) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = self.last = time.perf_counter()
        self.first_token_at: float | None = None
        self.num_tokens = 0
        self.is_ended = False

    def event(self, event: StreamEvent) -> None:
        m = self.metrics
        model = (m.model_name,)
        now = time.perf_counter()
        count = len(event.token_ids)
        if count:
            for counter in m.generation_tokens.labels(*model):
                counter.inc(count)
            if self.first_token_at is None:
                self.first_token_at = now
                for histogram in m.ttft.labels(*model):
                    histogram.observe(now - self.arrival)
                gaps = count - 1  # the rest of the first event's tokens came with it
                gap = 0.0
            else:
                gaps, gap = count, (now - self.last) / count
            for histogram in m.itl.labels(*model):
                for _ in range(gaps):
                    histogram.observe(gap)
            self.num_tokens += count
            self.last = now
        if event.num_cached_tokens is not None:
            for counter in m.prefix_queries.labels(*model):
                counter.inc(self.num_prompt_tokens)
            for counter in m.prefix_hits.labels(*model):
                counter.inc(event.num_cached_tokens)
        step = event.step
        if step is not None:
            if step.drafted_tokens:
                for counter in m.drafts.labels(*model):
                    counter.inc()
                for counter in m.draft_tokens.labels(*model):
                    counter.inc(step.drafted_tokens)
                for counter in m.accepted.labels(*model):
                    counter.inc(step.accepted_tokens)
                for position in range(min(step.accepted_tokens, MAX_POSITIONS)):
                    for counter in m.accepted_per_pos.labels(*model, str(position)):
                        counter.inc()
        if event.totals is not None:
            self.end(event.totals.finish_reason)
        elif event.error is not None:
            self.end("error")

    def end(self, finish_reason: str) -> None:
        """`finish_reason`: stop, length, abort (cancelled or failed)."""
        if self.is_ended:
            return
        self.is_ended = True
        m = self.metrics
        model = (m.model_name,)
        now = time.perf_counter()
        m.untrack()
        for counter in m.success.labels(*model, finish_reason):
            counter.inc()
        for histogram in m.e2e.labels(*model):
            histogram.observe(now - self.arrival)
        if self.first_token_at is not None and self.num_tokens > 1:
            for histogram in m.tpot.labels(*model):
                histogram.observe((now - self.first_token_at) / (self.num_tokens - 1))
