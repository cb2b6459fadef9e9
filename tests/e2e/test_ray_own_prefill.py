"""Ray without prefill workers (the default on CPU clusters of fewer than 4 CPUs): the decode
workers prefill their own prompts, inside their decode steps, on a real local Ray cluster
behind the real gRPC API. Greedy answers equal plain greedy decoding, and a decode worker
killed mid-answer changes nothing for the client (the other decode worker prefills the prompt
and the tokens already streamed, and goes on)."""

import os
import signal

import pytest

from sssd.client import GenerationClient, RetryPolicy
from sssd.drafter.config import DrafterConfig
from sssd.drafter.service import create_server
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.serving.config import RayConfig
from sssd.verifier.serving.frontend import FrontendConfig, start_frontend

from support.streams import stream_concurrently, token_ids

ray = pytest.importorskip("ray")  # installed by scripts/setup.sh (the serve extra)

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def stack(target_model_fp32, warm_datastore, free_port):
    server, port, drafter = create_server(DrafterConfig(
        datastore_dir=warm_datastore, vocab_size=target_model_fp32.vocab_size,
        tokenizer_fingerprint=target_model_fp32.fingerprint, host="127.0.0.1", port=0,
        num_threads=1))
    engine = EngineConfig(dtype="float32", mode="sssd", max_batch_size=4, max_len=1024,
                          drafter_target=f"127.0.0.1:{port}", drafter_timeout_s=1.0,
                          budget_policy="rule")
    ray_config = RayConfig(num_prefill_workers=0, num_decode_workers=2, auth="token",
                           dashboard_port=0, metrics_port=free_port(), num_cpus=2,
                           cpus_per_worker=0.5, object_store_bytes=128 << 20)
    frontend = start_frontend(FrontendConfig(engine=engine, port=0, http_port=0, max_requests=3,
                                             max_workers=8, grace_s=5.0, ray=ray_config))
    frontend.load()
    yield frontend
    frontend.stop(0)
    server.stop(grace=0).wait()
    drafter.close()


@pytest.fixture(scope="module")
def client(stack):
    with GenerationClient(f"127.0.0.1:{stack.port}", RetryPolicy(attempts=1)) as client:
        yield client


def test_decode_workers_that_prefill_answer_as_plain_decoding(client, stack, mt_bench_prompts,
                                                              greedy_references):
    assert stack.backend._prefill == [] and len(stack.backend._decode) == 2
    indices = (0, 3, 5)  # concurrent, mixed prompt lengths
    results = stream_concurrently(client, {i: mt_bench_prompts[i] for i in indices}, MAX_TOKENS)
    for index in indices:
        assert token_ids(results[index]) == greedy_references[index][:MAX_TOKENS]
        totals = results[index][-1].totals
        assert totals.completion_tokens == MAX_TOKENS and 0 < totals.time_to_first_token_s
    assert sum(c.accepted_tokens or 0 for i in indices for c in results[i]) > 0


def test_a_decode_worker_killed_mid_answer_changes_nothing_for_the_client(
        client, stack, mt_bench_prompts, greedy_references, wait_until):
    """Last in this module: it kills a worker (Ray restarts it)."""
    backend = stack.backend
    failovers = backend.num_failovers
    chunks, killed = [], None
    for chunk in client.stream(mt_bench_prompts[1], max_tokens=MAX_TOKENS):
        chunks.append(chunk)
        if killed is None and len(token_ids(chunks)) >= 8:
            (killed,) = list(backend._workers.values())
            os.kill(ray.get(killed.actor.ready.remote())["pid"], signal.SIGKILL)
    assert killed is not None, "the answer ended before the kill"
    assert token_ids(chunks) == greedy_references[1][:MAX_TOKENS]  # none missing or repeated
    assert chunks[-1].totals.completion_tokens == MAX_TOKENS
    assert backend.num_failovers == failovers + 1
    assert wait_until(lambda: all(slot.up for slot in backend._decode), timeout=120)
    assert wait_until(lambda: backend.num_requests == 0)
