"""The speculator over real gRPC on 127.0.0.1: bad input on every RPC, the engine through it,
the service killed, restarted and too slow, and the fingerprint check at connect."""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sssd.common.rpc.status import parse_unknown_ids
from sssd.speculator.client import RemoteSpeculator, SpeculatorProposer
from sssd.speculator.config import SpeculatorConfig
from sssd.speculator.service import SERVICE_NAME, create_server
from sssd.v1 import speculator_pb2, speculator_pb2_grpc
from sssd.verifier.engine import GenerateRequest
from sssd.verifier.engine.config import EngineConfig
from sssd.verifier.proposers import make_proposer

MAX_TOKENS = 24


def serve(speculator, port=0):
    server, port, _ = create_server(SpeculatorConfig(port=port), speculator)
    return server, port


@pytest.fixture
def service(make_speculator):
    speculator = make_speculator(8, lookahead=3, fanout_budget=8, critical_batch_size=8)
    server, port = serve(speculator)
    yield speculator, port
    server.stop(0).wait()
    speculator.close()


def rpc_error(call, message):
    with pytest.raises(grpc.RpcError) as info:
        call(message, timeout=10)
    return info.value.code(), info.value.details()


def test_bad_input_on_every_rpc_gets_a_clear_status(service, mt_bench_prompts,
                                                    target_model_fp32):
    speculator, port = service
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = speculator_pb2_grpc.SpeculatorStub(channel)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        start = speculator_pb2.SequenceRound(seq_id="a", is_start=True, budget=4,
                                             token_ids=mt_bench_prompts[2])
        first = stub.Round(speculator_pb2.RoundRequest(sequences=[start]), timeout=30)
        drafts = list(first.sequences[0].token_ids)
        assert len(drafts) == 3 and not first.sequences[0].hit

        def round_of(*sequences, fingerprint=""):
            return speculator_pb2.RoundRequest(sequences=sequences,
                                               tokenizer_fingerprint=fingerprint)

        seq = speculator_pb2.SequenceRound
        cases = [
            (round_of(), grpc.StatusCode.INVALID_ARGUMENT, "empty batch"),
            (round_of(seq(seq_id="x", token_ids=[1], budget=4), seq(seq_id="y", token_ids=[1])),
             grpc.StatusCode.NOT_FOUND, "unknown seq_ids"),
            (round_of(seq(seq_id="a", token_ids=drafts + [1], num_accepted=4, budget=4)),
             grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
            (round_of(seq(seq_id="a", token_ids=[49152], budget=4)),
             grpc.StatusCode.INVALID_ARGUMENT, "token ids must be in"),
            (round_of(seq(seq_id="a", token_ids=[1], budget=4), fingerprint="another"),
             grpc.StatusCode.FAILED_PRECONDITION, "tokenizer"),
            (round_of(seq(seq_id="", token_ids=[1])), grpc.StatusCode.INVALID_ARGUMENT,
             "non-empty"),
        ]
        for message, code, text in cases:
            got_code, details = rpc_error(stub.Round, message)
            assert got_code == code and text in details, (got_code, details)
        got_code, details = rpc_error(stub.Round, cases[1][0])
        assert parse_unknown_ids(details) == ["x", "y"]
        info = stub.GetInfo(speculator_pb2.SpeculatorInfoRequest(), timeout=10)
        assert info.num_sequences == 1 and info.rounds == 1  # nothing above changed the state
        assert info.tokenizer_fingerprint == target_model_fp32.fingerprint
        # The right outcome still continues the sequence.
        ok = stub.Round(round_of(seq(seq_id="a", token_ids=drafts[:1] + [5], num_accepted=1,
                                     budget=4), fingerprint=target_model_fp32.fingerprint),
                        timeout=30)
        assert len(ok.sequences[0].token_ids) == 3
        ended = stub.EndSequences(speculator_pb2.EndSpeculationRequest(seq_ids=["a", "zz"]),
                                  timeout=10)
        assert ended.num_ended == 1


def test_killed_mid_generation_then_restarted(make_speculator, engine_factory,
                                              target_model_fp32, mt_bench_prompts,
                                              greedy_references):
    speculator = make_speculator(8, lookahead=3, fanout_budget=8, critical_batch_size=8)
    server, port = serve(speculator)
    remote = RemoteSpeculator(f"127.0.0.1:{port}", timeout_s=5.0)
    engine, _ = engine_factory(2, proposer=SpeculatorProposer(remote), max_budget=4)
    restarted = None
    try:
        sequences = [engine.add_request(GenerateRequest(mt_bench_prompts[i], MAX_TOKENS))
                     for i in (0, 4)]
        for _ in range(3):
            engine.step()
        assert speculator.stats.rounds > 0 and engine.stats.num_draft_failures == 0
        server.stop(0).wait()  # down mid-generation: the steps decode without drafts
        for _ in range(2):
            engine.step()
        assert engine.stats.num_draft_failures == 2
        restarted = make_speculator(8, lookahead=3, fanout_budget=8, critical_batch_size=8)
        server, port = serve(restarted, port)
        time.sleep(1.2)  # the client's reconnect backoff is at most 1 s
        while engine.has_work():
            engine.step()
        assert restarted.stats.rounds > 0 and restarted.stats.hits > 0  # SSD resumed
        for seq, index in zip(sequences, (0, 4)):
            assert seq.output_ids == greedy_references[index][:MAX_TOKENS]
        assert restarted.num_sequences == 0  # the finished sequences were ended there
    finally:
        engine.close()
        server.stop(0).wait()
        speculator.close()
        if restarted is not None:
            restarted.close()


def test_speculator_past_its_deadline_is_skipped(make_speculator, engine_factory,
                                                 mt_bench_prompts, greedy_references):
    speculator = make_speculator(8, lookahead=3, fanout_budget=8)
    original = speculator.round

    def slow_round(inputs, fingerprint=None):
        time.sleep(0.3)
        return original(inputs, fingerprint)

    speculator.round = slow_round
    server, port = serve(speculator)
    engine, _ = engine_factory(1, proposer=SpeculatorProposer(RemoteSpeculator(
        f"127.0.0.1:{port}", timeout_s=0.05)), max_budget=4)
    try:
        assert engine.generate([mt_bench_prompts[1]], 10) == [greedy_references[1][:10]]
        assert engine.stats.num_draft_failures == engine.stats.num_steps > 0
        assert engine.stats.draft_s < 0.3 * engine.stats.num_steps  # it did not wait
    finally:
        engine.close()
        server.stop(0).wait()
        speculator.close()


def test_mode_ssd_refuses_a_draft_model_with_another_tokenizer(service, target_model_fp32):
    speculator, port = service
    config = EngineConfig(mode="ssd", speculator_target=f"127.0.0.1:{port}",
                          drafter_target="127.0.0.1:1")
    proposer = make_proposer(config, target_model_fp32)  # the same tokenizer: accepted
    proposer.close()
    speculator.fingerprint = "another-tokenizer"
    with pytest.raises(ValueError, match="refused"):
        make_proposer(config, target_model_fp32)
    with pytest.raises(ValueError, match="--speculator"):
        EngineConfig(mode="ssd")


def test_mode_ssd_serves_each_request_from_the_source_it_names(
        service, engine_factory, target_model_fp32, mt_bench_prompts, greedy_references):
    """The engine of mode ssd routes between the speculator and the SSSD drafter (here the
    in-process core with the input trie alone): each named source serves its request, auto
    takes one of them, and every answer is plain greedy decoding's."""
    speculator, port = service
    router = make_proposer(EngineConfig(mode="ssd", speculator_target=f"127.0.0.1:{port}",
                                        dtype="float32"), target_model_fp32)
    assert router.sources == ("ssd", "sssd")
    engine, _ = engine_factory(3, proposer=router, max_budget=4)
    try:
        sequences = [engine.add_request(GenerateRequest(tuple(mt_bench_prompts[i]), 12,
                                                        source=source))
                     for i, source in enumerate(("ssd", "sssd", ""))]
        owners = None
        while engine.has_work():
            engine.step()
            if owners is None and all(router.source_of(s.request_id) for s in sequences):
                owners = [router.source_of(s.request_id) for s in sequences]
        for index, seq in enumerate(sequences):
            assert seq.output_ids == greedy_references[index][:12]
        assert owners[:2] == ["ssd", "sssd"] and owners[2] in ("ssd", "sssd")
        summary = router.stats()
        # Only the requests routed to ssd reached the speculator; its client counted them.
        assert summary["ssd"]["rounds"] > 0 and summary["sssd"]["steps"] > 0
        rounds, rows = summary["ssd"]["rounds"], speculator.stats.rows
        if owners[2] == "sssd":
            assert rows == rounds  # one sequence per round
        else:
            assert rounds < rows <= 2 * rounds
        assert speculator.num_sequences == 0  # every sequence ended in the speculator
    finally:
        engine.close()


def test_prometheus_scrape_has_every_metric(make_speculator, free_port, mt_bench_prompts):
    import urllib.request

    from sssd.speculator.protocol import RoundInput
    from sssd.speculator.service import start_metrics

    speculator = make_speculator(8, lookahead=3, fanout_budget=8)
    try:
        port = free_port()
        start_metrics(speculator, port)
        prompt = list(mt_bench_prompts[2])
        drafts = speculator.round([RoundInput("m", prompt, budget=4, is_start=True)])[0].token_ids
        speculator._wait_for_speculation()
        (k, bonus) = next(iter(speculator._seqs["m"].predictions))
        assert speculator.round([RoundInput("m", drafts[:k] + [bonus], k, budget=4)])[0].hit
        speculator._wait_for_speculation()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                  if line.startswith("sssd_speculator_")}
        assert values["sssd_speculator_rounds_total"] == 2
        assert values["sssd_speculator_hits_total"] == 1
        assert values['sssd_speculator_misses_total{kind="jit"}'] == 1
        assert values['sssd_speculator_misses_total{kind="fallback"}'] == 0
        assert values["sssd_speculator_hit_rate"] == 0.5
        assert values["sssd_speculator_speculate_seconds_total"] > 0
        assert values["sssd_speculator_jit_seconds_total"] > 0
        assert 0 < values["sssd_speculator_acceptance_rate"] < 1
        assert values["sssd_speculator_sequences"] == 1
        fanout = [values[f'sssd_speculator_fanout{{k="{k}"}}'] for k in range(4)]
        assert sum(fanout) == 8 and min(fanout) >= 1
    finally:
        speculator.close()


@pytest.mark.model  # the subprocess loads the default model
def test_sigterm_drains_and_exits_cleanly(spawn_service):
    """The console script end to end: SERVING, then SIGTERM: NOT_SERVING, rounds refused,
    exit 0."""
    import signal
    import sys

    process, port = spawn_service([
        sys.executable, "-m", "sssd.speculator.service", "--port", "0", "--metrics-port", "0",
        "--draft-layers", "2", "--dtype", "float32", "--grace-s", "5"])
    # The grace period outlasts a slow reader of the NOT_SERVING update on a busy machine; the
    # process still exits at once when this client closes its Watch stream.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert process.wait(timeout=60) == 0, process.stderr.read()[-4000:]  # an abort says why
    assert "speculator stopped" in process.stderr.read()
