"""Serving metrics through `ray.util.metrics` (docs/operations.md, "Metrics").

Ray's per-node metrics agent exports them on its Prometheus endpoint (the `metrics_port` of the
local cluster) and the Ray dashboard charts them; every name starts with `sssd_` (Prometheus
shows it as `ray_sssd_...`). They are recorded inside the workers (Ray actors), tagged with the
worker's name. Outside a Ray worker `ray.util.metrics` does nothing, so the single-process mode
uses no metrics observer.
"""

from __future__ import annotations

import time
from collections import deque

from sssd.common.drafting.proposer import Proposer
from sssd.common.rpc.totals import Totals
from sssd.verifier.engine.output import StepOutput
from sssd.verifier.engine.sequence import Sequence
from sssd.verifier.serving.backend import EngineGauges
from sssd.verifier.serving.errors import StreamError
from sssd.verifier.serving.observers import LoopObserver

# Milliseconds: CPU verification steps take 20-200 ms, drafts 0.05-5 ms, prefills up to seconds.
LATENCY_BOUNDARIES_MS = [0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
WINDOW_STEPS = 32  # steps averaged into the tokens-per-second and accepted-length gauges
# Gauges are set at most this often: Ray exports every few seconds, and the loop calls on_queue
# on every pass, which is every decoding step when busy.
GAUGE_REFRESH_S = 1.0


class DecodeMetrics(LoopObserver):
    """The decode worker's metrics: requests, tokens, speed, speculation, queue, drafter."""

    def __init__(self, worker: str, publisher=None, proposer: Proposer | None = None) -> None:
        """`publisher`: the worker's ConversationPublisher (live datastore), if any;
        `proposer`: the engine's, whose per-source `stats()` are read on the loop's thread."""
        # Imported here: ray.util.metrics loads Ray, which only a worker inside Ray has.
        from ray.util import metrics

        tags = ("worker",)
        self.requests = metrics.Counter(
            "sssd_requests", "Requests finished, by finish reason (stop, length, cancelled, error)",
            tag_keys=("worker", "finish_reason"))
        self.tokens = metrics.Counter("sssd_tokens_generated", "Output tokens generated",
                                      tag_keys=tags)
        self.tokens_per_second = metrics.Gauge(
            "sssd_tokens_per_second",
            f"Output tokens per second of the decode worker over its last {WINDOW_STEPS} steps",
            tag_keys=tags)
        self.accepted = metrics.Gauge(
            "sssd_mean_accepted_tokens",
            f"Tokens per sequence per verification step (accepted + bonus), last {WINDOW_STEPS} "
            "steps", tag_keys=tags)
        self.budget = metrics.Gauge("sssd_speculation_budget",
                                    "Speculation budget (draft tree nodes) of the latest step",
                                    tag_keys=tags)
        self.draft_ms = metrics.Histogram("sssd_draft_latency_ms", "Drafter call per step, ms",
                                          boundaries=LATENCY_BOUNDARIES_MS, tag_keys=tags)
        self.verify_ms = metrics.Histogram("sssd_verify_step_latency_ms",
                                           "Verification forward pass per step, ms",
                                           boundaries=LATENCY_BOUNDARIES_MS, tag_keys=tags)
        self.queue_depth = metrics.Gauge("sssd_queue_depth",
                                         "Requests waiting to enter the running batch",
                                         tag_keys=tags)
        self.running = metrics.Gauge("sssd_running_sequences", "Sequences in the running batch",
                                     tag_keys=tags)
        self.kv_usage = metrics.Gauge("sssd_kv_cache_usage",
                                      "Fraction of the KV cache's blocks held by sequences",
                                      tag_keys=tags)
        self.prefix_queries = metrics.Counter(
            "sssd_prefix_cache_queries", "Prompt tokens of finished requests looked up in the "
            "prefix cache", tag_keys=tags)
        self.prefix_hits = metrics.Counter(
            "sssd_prefix_cache_hits", "Prompt tokens of finished requests found in the prefix "
            "cache (their keys and values not computed again)", tag_keys=tags)
        self.preemptions = metrics.Gauge(
            "sssd_preemptions", "Sequences preempted for want of KV blocks (all time)",
            tag_keys=tags)
        self.drafter_errors = metrics.Counter(
            "sssd_drafter_errors", "Errors from the drafter (NOT_FOUND resends included)",
            tag_keys=tags)
        self.drafter_fallbacks = metrics.Counter(
            "sssd_drafter_fallbacks", "Steps decoded without speculation because the drafter "
            "failed", tag_keys=tags)
        self.publisher = publisher
        self.conversations = metrics.Gauge(
            "sssd_conversations", "Completed conversations for the live datastore, by state: "
            "published (in the stream), spooled (ever written to the disk spool while Redis was "
            "away), dropped (spool full)", tag_keys=("worker", "state"))
        self.proposer = proposer
        self.sources = metrics.Gauge(
            "sssd_drafting_source", "Per drafting source (sssd, ssd), by stat: steps, sequences, "
            "tokens_per_step, draft_ms, tokens_per_second (what speculation auto chooses by); "
            "for ssd also rounds, hits, misses, fallbacks, fallback_errors of the speculation "
            "cache", tag_keys=("worker", "source", "stat"))
        for metric in (self.requests, self.tokens, self.tokens_per_second, self.accepted,
                       self.budget, self.draft_ms, self.verify_ms, self.queue_depth, self.running,
                       self.kv_usage, self.prefix_queries, self.prefix_hits, self.preemptions,
                       self.drafter_errors, self.drafter_fallbacks, self.conversations,
                       self.sources):
            metric.set_default_tags({"worker": worker})
        self._window: deque[tuple[float, int, int, float]] = deque(maxlen=WINDOW_STEPS)
        self._num_row_steps = 0  # sequence-steps verified with drafts (all time)
        self._last: dict[str, float] = {}  # gauge values, re-set while idle
        self._refreshed = float("-inf")  # monotonic time the gauges were last set

    def on_step(self, step: StepOutput, step_s: float) -> None:
        self.tokens.inc(sum(len(row.token_ids) for row in step.rows))
        if step.num_draft_errors:
            self.drafter_errors.inc(step.num_draft_errors)
        if step.is_draft_fallback:
            self.drafter_fallbacks.inc(1)
        if not step.num_verified:  # admissions only: no verification to report
            return
        verified = [row for row in step.rows if row.is_verified]
        self._window.append((step_s, step.num_verified,
                             sum(row.num_accepted + 1 for row in verified), step.draft_s))
        if step.budget > 1:
            self._num_row_steps += step.num_verified
        seconds = sum(s for s, _, _, _ in self._window)
        rows = sum(r for _, r, _, _ in self._window)
        tokens = sum(t for _, _, t, _ in self._window)
        if seconds > 0:
            self._last["tokens_per_second"] = tokens / seconds
        if rows:
            self._last["accepted"] = tokens / rows
        self._last["budget"] = step.budget
        if step.budget > 1:
            self.draft_ms.observe(1e3 * step.draft_s)
        self.verify_ms.observe(1e3 * step.verify_s)

    def on_finish(self, seq: Sequence | None, totals: Totals | None,
                  error: StreamError | None) -> None:
        reason = totals.finish_reason if totals is not None else "error"
        self.requests.inc(1, tags={"finish_reason": reason})
        if seq is not None and seq.num_cached_tokens is not None:
            self.prefix_queries.inc(len(seq.request.context_ids))
            if seq.num_cached_tokens:
                self.prefix_hits.inc(seq.num_cached_tokens)

    def on_queue(self, gauges: EngineGauges) -> None:
        """Called every loop pass, idle ones included: all gauges are (re)set here, at most once
        per GAUGE_REFRESH_S, so they stay in Ray's export while the worker is idle (the windowed
        ones keep describing the last steps made)."""
        now = time.monotonic()
        if now - self._refreshed < GAUGE_REFRESH_S:
            return
        self._refreshed = now
        self.queue_depth.set(gauges.num_waiting)
        self.running.set(gauges.num_running)
        self.kv_usage.set(gauges.kv_cache_usage)
        self.preemptions.set(gauges.num_preemptions)
        for name, gauge in (("tokens_per_second", self.tokens_per_second),
                            ("accepted", self.accepted), ("budget", self.budget)):
            if name in self._last:
                gauge.set(self._last[name])
        if self.publisher is not None:
            stats = self.publisher.stats
            for state in ("published", "spooled", "dropped"):
                self.conversations.set(getattr(stats, state), tags={"state": state})
        for source, stats in self._source_stats().items():
            for stat, value in stats.items():
                self.sources.set(float(value), tags={"source": source, "stat": stat})

    def _source_stats(self) -> dict[str, dict[str, float]]:
        """Per drafting source, the proposer's own figures; a lone source's are the worker's
        (every step drafts from it), from the same window as the worker's gauges."""
        if self.proposer is None:
            return {}
        stats = self.proposer.stats()
        if len(self.proposer.sources) == 1 and self._window:
            (source,) = self.proposer.sources
            seconds = sum(s for s, _, _, _ in self._window)
            rows = sum(r for _, r, _, _ in self._window)
            tokens = sum(t for _, _, t, _ in self._window)
            own = {"steps": self._num_row_steps,
                   "tokens_per_step": tokens / rows if rows else 0.0,
                   "draft_ms": 1e3 * sum(d for _, _, _, d in self._window) / len(self._window),
                   # What one sequence gets, as the router reports it per source.
                   "tokens_per_second": tokens / rows / (seconds / len(self._window))
                   if rows and seconds else 0.0}
            stats = {source: {**own, **stats.get(source, {})}}
        return stats


class PrefillMetrics:
    def __init__(self, worker: str) -> None:
        from ray.util import metrics  # as in DecodeMetrics: inside a Ray worker only

        self.prefills = metrics.Counter("sssd_prefills", "Prompts prefilled",
                                        tag_keys=("worker",))
        self.prompt_tokens = metrics.Counter("sssd_prompt_tokens", "Prompt tokens prefilled",
                                             tag_keys=("worker",))
        self.prefill_ms = metrics.Histogram("sssd_prefill_latency_ms",
                                            "Prefill forward pass, ms",
                                            boundaries=LATENCY_BOUNDARIES_MS,
                                            tag_keys=("worker",))
        self.cached_tokens = metrics.Counter(
            "sssd_prefill_cached_tokens", "Prompt tokens found in the prefill worker's prefix "
            "cache (not computed again)", tag_keys=("worker",))
        for metric in (self.prefills, self.prompt_tokens, self.prefill_ms, self.cached_tokens):
            metric.set_default_tags({"worker": worker})

    def record(self, num_tokens: int, seconds: float, num_cached: int = 0) -> None:
        self.prefills.inc(1)
        self.prompt_tokens.inc(num_tokens)
        if num_cached:
            self.cached_tokens.inc(num_cached)
        self.prefill_ms.observe(1e3 * seconds)
