"""Prefill/decode disaggregation on a real local Ray cluster behind the real gRPC API.

One module-scoped stack: a drafter gRPC service (in this process) on 127.0.0.1, a local Ray
cluster on 127.0.0.1 with token authentication (the default), one prefill and two decode
workers (float32, so outputs compare exactly with the greedy references), and the gRPC
frontend. The last test kills workers.
"""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import grpc
import pytest

from sssd.client import GenerationClient, RetryPolicy
from sssd.drafter.config import DrafterConfig
from sssd.drafter.service import create_server
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.serving.config import RayConfig
from sssd.verifier.serving.frontend import FrontendConfig, start_frontend
from sssd.verifier.serving.ray_auth import configure_auth

from support.streams import stream_concurrently, token_ids

ray = pytest.importorskip("ray")  # installed by scripts/setup.sh (the serve extra)

MAX_TOKENS = 40


class DrafterService:
    """The drafter gRPC service on a fixed port, so it can be stopped and started again."""

    def __init__(self, loaded, datastore, port):
        self.config = DrafterConfig(datastore_dir=datastore, vocab_size=loaded.vocab_size,
                                    tokenizer_fingerprint=loaded.fingerprint, host="127.0.0.1",
                                    port=port, num_threads=1)
        self.server = self.drafter = None

    def start(self):
        self.server, _, self.drafter = create_server(self.config)

    def stop(self):
        if self.server is not None:
            self.server.stop(grace=0).wait()
            self.drafter.close()
            self.server = self.drafter = None


@pytest.fixture(scope="module")
def drafter_service(target_model_fp32, warm_datastore, free_port):
    service = DrafterService(target_model_fp32, warm_datastore, free_port())
    service.start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def stack(drafter_service, free_port, redis_server, tmp_path_factory):
    from sssd.common.conversations.publisher import PublishConfig

    metrics_port = free_port()
    publish = PublishConfig(redis_server.url, str(tmp_path_factory.mktemp("spool")),
                            stream="test:ray")
    engine = EngineConfig(dtype="float32", mode="sssd", max_batch_size=4, max_len=1024,
                          drafter_target=f"127.0.0.1:{drafter_service.config.port}",
                          drafter_timeout_s=1.0, budget_policy="rule")
    ray_config = RayConfig(num_prefill_workers=1, num_decode_workers=2, auth="token",
                           dashboard_port=0, metrics_port=metrics_port, num_cpus=2,
                           cpus_per_worker=0.5, object_store_bytes=256 << 20,
                           metrics_report_interval_ms=500)
    frontend = start_frontend(FrontendConfig(engine=engine, port=0, http_port=0, max_requests=3,
                                             max_workers=8, grace_s=5.0, ray=ray_config,
                                             publish=publish))
    frontend.load()
    yield frontend
    frontend.stop(0)


@pytest.fixture(scope="module")
def client(stack):
    with GenerationClient(f"127.0.0.1:{stack.port}", RetryPolicy(attempts=1)) as client:
        yield client


def decode_requests(stack):
    """Requests held by the decode workers, all of them."""
    return sum(ray.get([slot.actor.num_requests.remote() for slot in stack.backend._decode]))


def test_prefill_decode_output_equals_single_worker(client, engine_factory, mt_bench_prompts,
                                                    greedy_references):
    indices = (0, 3, 5)  # mixed prompt lengths, decoded concurrently in one batch
    results = stream_concurrently(client, {i: mt_bench_prompts[i] for i in indices}, MAX_TOKENS)
    engine, drafter = engine_factory(len(indices))  # the single-process engine
    try:
        single = engine.generate([mt_bench_prompts[i] for i in indices], MAX_TOKENS)
    finally:
        drafter.close()
    for index, expected in zip(indices, single):
        assert token_ids(results[index]) == expected == greedy_references[index][:MAX_TOKENS]
        totals = results[index][-1].totals
        assert totals.completion_tokens == MAX_TOKENS and totals.finish_reason == "length"
        assert 0 < totals.time_to_first_token_s < totals.total_s
    accepted = sum(c.accepted_tokens or 0 for i in indices for c in results[i])
    assert accepted > 0  # the decode worker speculated through the drafter service


def test_concurrency_limit_is_resource_exhausted(client, stack, mt_bench_prompts, wait_until):
    streams = [client.stream(mt_bench_prompts[i], max_tokens=200) for i in range(3)]
    for stream in streams:
        next(stream)  # each holds a slot now
    with pytest.raises(grpc.RpcError) as error:
        client.generate(mt_bench_prompts[4], max_tokens=4)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for stream in streams:
        stream.close()  # client cancels
    assert wait_until(lambda: stack.backend.num_requests == 0)


def test_cancel_frees_the_sequence_in_the_decode_worker(client, stack, mt_bench_prompts,
                                                        wait_until):
    stream = client.stream(mt_bench_prompts[1], max_tokens=400)
    next(stream)
    assert decode_requests(stack) == 1
    stream.close()
    assert wait_until(lambda: decode_requests(stack) == 0)
    assert wait_until(lambda: stack.backend.num_requests == 0)


def test_deadline_ends_the_request(stack, mt_bench_prompts, wait_until):
    with GenerationClient(f"127.0.0.1:{stack.port}", RetryPolicy(attempts=1),
                          timeout_s=0.5) as short:
        with pytest.raises(grpc.RpcError) as error:
            short.generate(mt_bench_prompts[2], max_tokens=600)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: decode_requests(stack) == 0)


def test_bad_input_is_invalid_argument(client, stack):
    with pytest.raises(grpc.RpcError) as error:
        client.generate([10**9], max_tokens=4)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in error.value.details()


def test_drafter_killed_then_restarted_over_the_api(client, drafter_service, mt_bench_prompts,
                                                    greedy_references):
    drafter_service.stop()
    try:
        chunks = list(client.stream(mt_bench_prompts[6], max_tokens=24))
        assert token_ids(chunks) == greedy_references[6][:24]  # completed without drafts
        assert all((c.accepted_tokens or 0) == 0 for c in chunks)
    finally:
        drafter_service.start()
    time.sleep(1.2)  # the remote drafter's reconnect backoff is at most 1 s
    chunks = list(client.stream(mt_bench_prompts[0], max_tokens=MAX_TOKENS))
    assert token_ids(chunks) == greedy_references[0][:MAX_TOKENS]
    assert sum(c.accepted_tokens or 0 for c in chunks) > 0  # speculation resumed


METRICS = ("sssd_requests", "sssd_tokens_generated", "sssd_tokens_per_second",
           "sssd_mean_accepted_tokens", "sssd_speculation_budget", "sssd_draft_latency_ms",
           "sssd_verify_step_latency_ms", "sssd_drafter_errors",
           "sssd_drafter_fallbacks", "sssd_prefill_latency_ms", "sssd_conversations",
           "sssd_drafting_source")


def scrape(url: str) -> dict[str, float]:
    """The largest sample of each sssd metric family on the Prometheus endpoint."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"ray_(sssd_\w+?)(_total|_sum|_count|_bucket)?(\{.*\})? (\S+)$", line)
        if match:
            name, value = match.group(1), float(match.group(4))
            values[name] = max(values.get(name, 0.0), value)
    return values


def test_metrics_on_the_prometheus_endpoint(client, stack, mt_bench_prompts, wait_until,
                                            redis_server):
    client.generate(mt_bench_prompts[0], max_tokens=16)
    url = stack.backend.endpoints["metrics"]
    values: dict[str, float] = {}

    def all_reported():
        nonlocal values
        values = scrape(url)
        return all(values.get(name, 0) > 0 for name in METRICS)

    # The drafter was down in an earlier test, so its error counters are non-zero too.
    assert wait_until(all_reported, timeout=30), \
        f"missing or zero: {[n for n in METRICS if values.get(n, 0) <= 0]}"
    # Gauges that are legitimately 0 once the server is idle again.
    assert "sssd_queue_depth" in values and "sssd_running_sequences" in values
    # The decode worker published the completed conversations to the live datastore's stream.
    import redis

    stream_length = redis.Redis.from_url(redis_server.url).xlen("test:ray")
    assert stream_length >= values["sssd_conversations"] > 0
    # Ray drops a gauge about 10 s after its last update; the idle loop keeps re-setting them.
    time.sleep(12)
    idle = scrape(url)
    assert {"sssd_queue_depth", "sssd_running_sequences", "sssd_tokens_per_second",
            "sssd_speculation_budget", "sssd_conversations"} <= set(idle)


def test_a_source_the_workers_lack_is_refused_before_prefill(client, stack):
    with pytest.raises(grpc.RpcError) as info:
        client.generate("hi", max_tokens=4, speculation="ssd")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no 'ssd' drafting source (it has sssd" in info.value.details()
    assert stack.backend.num_requests == 0


def test_the_cluster_refuses_a_wrong_token(stack):
    """Token auth is really on: a driver with the wrong token cannot join the cluster."""
    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
    script = f"import ray; ray.init(address={address!r}, log_to_driver=False)"
    joined = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert joined.returncode != 0
    assert "auth" in (joined.stderr + joined.stdout).lower()


def test_generated_token_file_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    path = configure_auth(RayConfig(token_file=str(tmp_path / "ray" / "auth_token")))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert open(path).read().strip() == os.environ["RAY_AUTH_TOKEN"]
    assert len(os.environ["RAY_AUTH_TOKEN"]) == 64 and os.environ["RAY_AUTH_MODE"] == "token"


def test_auth_disabled_only_on_loopback():
    with pytest.raises(ValueError, match="loopback"):
        RayConfig(auth="disabled", host="0.0.0.0")
    with pytest.raises(ValueError, match="auth must be one of"):
        RayConfig(auth="none")
    assert RayConfig(auth="disabled", host="127.0.0.1").auth == "disabled"


def kill_worker_of(stack, kind="decode"):
    """SIGKILLs the process of the (only) decode worker holding a request, or the prefill
    worker, as a crash would; returns its slot."""
    backend = stack.backend
    if kind == "decode":
        (slot,) = list(backend._workers.values())
    else:
        (slot,) = backend._prefill
    pid = ray.get(slot.actor.ready.remote())["pid"]
    os.kill(pid, signal.SIGKILL)
    return slot


def stream_with_a_kill(client, stack, prompt, kind="decode", after_tokens=8, **options):
    """Streams an answer; once `after_tokens` arrived, kills the decode worker serving it."""
    chunks, killed = [], None
    for chunk in client.stream(prompt, max_tokens=MAX_TOKENS, **options):
        chunks.append(chunk)
        if killed is None and len(token_ids(chunks)) >= after_tokens:
            killed = kill_worker_of(stack, kind)
    assert killed is not None, "the answer ended before the kill"
    return chunks, killed


def test_workers_killed_mid_answer_change_nothing_for_the_client(
        client, stack, mt_bench_prompts, greedy_references, target_model_fp32, redis_server,
        wait_until):
    """Last in this module: it kills workers (Ray restarts them)."""
    import redis

    backend = stack.backend
    tokenizer = target_model_fp32.tokenizer
    published = redis.Redis.from_url(redis_server.url)
    failovers, conversations = backend.num_failovers, published.xlen("test:ray")

    # A decode worker dies mid-answer: the other one goes on from the tokens streamed.
    chunks, killed = stream_with_a_kill(client, stack, mt_bench_prompts[1])
    reference = greedy_references[1][:MAX_TOKENS]
    assert token_ids(chunks) == reference  # nothing missing, nothing repeated
    assert "".join(c.text for c in chunks) == tokenizer.decode(reference,
                                                               skip_special_tokens=True)
    totals = chunks[-1].totals
    assert totals.completion_tokens == MAX_TOKENS and totals.finish_reason == "length"
    assert backend.num_failovers == failovers + 1
    assert not killed.up  # out of routing until Ray has restarted it

    # Seeded sampling goes on identically: randomness keyed by (seed, position).
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234)
    expected = client.generate(mt_bench_prompts[2], max_tokens=MAX_TOKENS, **sampled)
    chunks, _ = stream_with_a_kill(client, stack, mt_bench_prompts[2], **sampled)
    assert token_ids(chunks) == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text

    # Both restarted workers come back into routing; then the prefill worker dies (the only
    # one): the next request waits for its restart and is prefilled there.
    assert wait_until(lambda: all(slot.up for slot in backend._decode), timeout=120)
    kill_worker_of(stack, "prefill")
    answer = client.generate(mt_bench_prompts[3], max_tokens=16)
    assert answer.token_ids == greedy_references[3][:16]
    assert backend.num_failovers >= failovers + 3
    assert wait_until(lambda: all(slot.up for slot in backend._prefill), timeout=120)
    # Every conversation reached the live datastore's stream once: 4 requests, 4 entries.
    assert wait_until(lambda: published.xlen("test:ray") == conversations + 4, timeout=30)
    assert wait_until(lambda: backend.num_requests == 0)


def test_a_request_out_of_failovers_fails_with_internal(client, stack, mt_bench_prompts,
                                                        monkeypatch, wait_until):
    """With no failover allowed, a dead decode worker fails its request (no hang)."""
    monkeypatch.setattr(stack.backend, "ray_config",
                        replace(stack.backend.ray_config, max_failovers=0))
    assert wait_until(lambda: all(slot.up for slot in stack.backend._decode), timeout=120)
    stream = client.stream(mt_bench_prompts[1], max_tokens=400)
    next(stream)
    kill_worker_of(stack)
    with pytest.raises(grpc.RpcError) as error:
        for _ in stream:
            pass
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert "worker failure" in error.value.details() and "died" in error.value.details()
    assert wait_until(lambda: stack.backend.num_requests == 0)
