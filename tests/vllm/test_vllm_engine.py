"""vLLM itself verifying drafts from our drafter service: greedy outputs equal vLLM without
speculation, a drafter killed mid-run changes nothing, a drafter of another tokenizer is refused.

These run in .venv-vllm (scripts/setup_vllm.sh; scripts/test.sh runs them there after the main
suite) and are skipped where vLLM is not installed. vLLM 0.32's CPU build, SmolLM2-135M in
float32 from `sssd.vllm.export_model`, engines in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that the proposer's counters can be read; the drafter is a real `sssd-drafter` process on
127.0.0.1.
"""

from __future__ import annotations

import gc
import signal
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm: scripts/test.sh runs these "
                           "tests there (scripts/setup_vllm.sh)")

NUM_PROMPTS = 6
MAX_TOKENS = 40
K = 4
PROPOSER = "sssd.vllm.proposer.VllmDrafterProposer"


@pytest.fixture(scope="module")
def in_process_engines():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes far more
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from sssd.vllm.export_model import export_model

    return str(export_model(tmp_path_factory.mktemp("vllm") / "smollm2"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from sssd.common.data.corpus import first_turns, read_mt_bench

    out = []
    for text in first_turns(read_mt_bench())[:NUM_PROMPTS]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def make_llm(model_dir, **kwargs):
    return vllm.LLM(model=model_dir, dtype="float32", max_model_len=1024, enforce_eager=True,
                    max_num_seqs=NUM_PROMPTS, disable_log_stats=False, seed=0, **kwargs)


def greedy():
    return vllm.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def generate(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_counts(llm):
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return (metrics.get("vllm:spec_decode_num_drafts") or 0,
            metrics.get("vllm:spec_decode_num_accepted_tokens") or 0)


def proposer_counts(llm):
    """(calls, failed calls) of the VllmDrafterProposer inside the engine's worker."""
    def read(worker):
        drafter = worker.model_runner.drafter
        return drafter.num_calls, drafter.num_failures

    return tuple(llm.collective_rpc(read)[0])


@pytest.fixture(scope="module")
def references(in_process_engines, model_dir, prompts):
    """vLLM's own greedy outputs without speculation, from an engine freed afterwards."""
    llm = make_llm(model_dir)
    outputs = generate(llm, prompts)
    del llm
    gc.collect()
    return outputs


@pytest.fixture(scope="module")
def datastore(tmp_path_factory, tokenizer, references):
    """vLLM's answers to half the prompts, so that drafts are accepted, and nothing else."""
    from sssd.common.model.tokenizer import tokenizer_fingerprint
    from sssd.datastore.build import build_datastore

    directory = tmp_path_factory.mktemp("datastore")
    build_datastore(directory, references[::2], len(tokenizer), tokenizer_fingerprint(tokenizer),
                    shard_tokens=8000)
    return directory


def drafter_args(*extra):
    return [str(Path(sys.executable).with_name("sssd-drafter")), "--vocab-size", "49152",
            "--num-threads", "1", *extra]


@pytest.fixture(scope="module")
def drafter(datastore, tokenizer):
    """The drafter process and its port: start(port=0) (re)starts it, kill() SIGKILLs it."""
    import os
    import re
    import subprocess

    from sssd.common.model.tokenizer import tokenizer_fingerprint

    class DrafterProcess:
        process = None
        port = 0

        def start(self):
            self.process = subprocess.Popen(
                drafter_args("--datastore-dir", str(datastore), "--tokenizer-fingerprint",
                             tokenizer_fingerprint(tokenizer), "--port", str(self.port)),
                stderr=subprocess.PIPE, text=True, env={**os.environ, "SSSD_LOG_LEVEL": "INFO"})
            for line in self.process.stderr:
                if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                    self.port = int(match.group(1))
                    return
            raise AssertionError(f"sssd-drafter exited with {self.process.wait()}")

        def kill(self):
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    drafter = DrafterProcess()
    drafter.start()
    yield drafter
    if drafter.process.poll() is None:
        drafter.process.kill()
        drafter.process.wait(10)


@pytest.fixture(scope="module")
def spec_llm(in_process_engines, model_dir, drafter, references):
    config = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": K}
    llm = make_llm(model_dir, speculative_config=config,
                   additional_config={"sssd": {"drafter": f"127.0.0.1:{drafter.port}",
                                               "timeout_s": 1.0}})
    yield llm
    del llm
    gc.collect()


def test_greedy_outputs_equal_vllm_without_speculation(spec_llm, prompts, references):
    assert generate(spec_llm, prompts) == references
    drafts, accepted = spec_counts(spec_llm)
    calls, failures = proposer_counts(spec_llm)
    assert calls > 0 and failures == 0
    assert drafts > 0 and accepted > 0, (drafts, accepted)
    # Half the answers are in the datastore: drafts that hit them are accepted whole.
    assert 1 + accepted / drafts >= 1.5, (drafts, accepted)


def test_a_drafter_killed_mid_run_changes_no_output_and_is_used_again_once_back(
        spec_llm, drafter, prompts, references):
    engine = spec_llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"kill-{i}", {"prompt_token_ids": prompt}, greedy())
    drafts_before, _ = spec_counts(spec_llm)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
        if steps == 4:
            assert spec_counts(spec_llm)[0] > drafts_before  # it was drafting
            assert not finished
            drafter.kill()
            calls_at_kill, failures_at_kill = proposer_counts(spec_llm)
    assert steps > 8
    assert [finished[f"kill-{i}"] for i in range(len(prompts))] == references
    calls, failures = proposer_counts(spec_llm)
    assert failures > failures_at_kill and calls > calls_at_kill  # it kept trying, never failed

    drafter.start()  # same port: the proposer's channel reconnects
    drafts_back, accepted_back = spec_counts(spec_llm)
    assert generate(spec_llm, prompts) == references
    drafts, accepted = spec_counts(spec_llm)
    assert drafts > drafts_back and accepted > accepted_back


def test_a_drafter_with_another_tokenizer_is_refused_at_start(in_process_engines, model_dir,
                                                              spawn_service):
    _, port = spawn_service(drafter_args("--tokenizer-fingerprint", "0" * 64, "--port", "0"))
    config = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": K}
    with pytest.raises(Exception, match="tokenizer .* refused") as refused:
        make_llm(model_dir, speculative_config=config,
                 additional_config={"sssd": {"drafter": f"127.0.0.1:{port}"}})
    assert "0" * 12 in str(refused.value)
    gc.collect()


def test_bad_proposer_settings_stop_vllm_with_the_reason(in_process_engines, model_dir):
    config = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": K}
    with pytest.raises(Exception, match="unknown field.*budgett"):
        make_llm(model_dir, speculative_config=config,
                 additional_config={"sssd": {"drafter": "127.0.0.1:1", "budgett": 8}})
    gc.collect()


def test_conversations_served_by_vllm_reach_the_live_datastore_once(
        in_process_engines, model_dir, drafter, tokenizer, prompts, references, redis_server,
        tmp_path, wait_until):
    import time

    import numpy as np
    import redis

    from sssd.common.model.tokenizer import tokenizer_fingerprint

    stream = "test:vllm-live"
    config = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": K}
    llm = make_llm(model_dir, speculative_config=config, additional_config={"sssd": {
        "drafter": f"127.0.0.1:{drafter.port}", "timeout_s": 1.0, "redis_url": redis_server.url,
        "stream": stream, "spool_dir": str(tmp_path / "spool"), "idle_s": 5.0}})
    try:
        assert generate(llm, prompts[:3]) == references[:3]
        client = redis.Redis.from_url(redis_server.url)

        def entries():
            return [(np.frombuffer(f[b"prompt"], "<u4").tolist(),
                     np.frombuffer(f[b"output"], "<u4").tolist(), f[b"fingerprint"].decode())
                    for _, f in client.xrange(stream)]

        # vLLM is idle after generate: within idle_s every row has ended and is published.
        assert wait_until(lambda: len(entries()) == 3, timeout=30)
        fingerprint = tokenizer_fingerprint(tokenizer)
        by_prompt = {tuple(prompt): (answer, fp) for prompt, answer, fp in entries()}
        assert set(by_prompt) == {tuple(p) for p in prompts[:3]}
        for prompt, answer in zip(prompts, references[:3]):
            published, fp = by_prompt[tuple(prompt)]
            assert fp == fingerprint
            # What the client got, and at most the rest of the last verification step: vLLM's
            # token table holds every accepted token, the reply is cut at max_tokens.
            assert published[:len(answer)] == answer
            assert len(published) - len(answer) <= K
        time.sleep(6)
        published = entries()
        assert len(published) == 3  # each once
        # The indexer turns them into a datastore shard, as it does the engine's.
        from sssd.datastore.build import read_documents
        from sssd.indexer.indexer import Indexer, IndexerConfig

        live = tmp_path / "live"
        live.mkdir()
        indexer = Indexer(IndexerConfig(
            datastore_dir=str(live), vocab_size=len(tokenizer), tokenizer_fingerprint=fingerprint,
            redis_url=redis_server.url, stream=stream, build_tokens=1, block_ms=100))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
                indexer.stats.builds == 0 or len(read_documents(live)) < 3):
            indexer.poll()
        # (the indexer trims what it has built from the stream)
        assert sorted(read_documents(live)) == sorted(p + a for p, a, _ in published)
    finally:
        del llm
        gc.collect()
