"""The engine with the real gRPC drafter service: killed, restarted, too slow. Nothing is lost."""

import socket
import time

from sssd.drafter.client import RemoteDrafter
from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import LocalDrafter
from sssd.drafter.service import create_server
from sssd.verifier.engine import GenerateRequest

MAX_TOKENS = 40


def start_drafter(loaded, datastore_dir, port=0):
    return create_server(DrafterConfig(
        datastore_dir=datastore_dir, vocab_size=loaded.vocab_size,
        tokenizer_fingerprint=loaded.fingerprint, host="127.0.0.1", port=port, num_threads=1))


def stop_drafter(server, drafter):
    server.stop(grace=0).wait()
    drafter.close()


def steps(engine, count):
    for _ in range(count):
        if engine.has_work():
            engine.step()


def test_drafter_killed_mid_generation_then_restarted(engine_factory, target_model_fp32,
                                                     mt_bench_prompts, greedy_references,
                                                     warm_datastore):
    server, port, drafter = start_drafter(target_model_fp32, warm_datastore)
    remote = RemoteDrafter(f"127.0.0.1:{port}", timeout_s=1.0)
    engine, _ = engine_factory(2, proposer=remote, max_budget=8)
    try:
        sequences = [engine.add_request(GenerateRequest(mt_bench_prompts[i], MAX_TOKENS))
                     for i in (0, 2, 3)]
        steps(engine, 4)
        assert engine.stats.num_accepted > 0 and engine.stats.num_draft_failures == 0
        stop_drafter(server, drafter)  # down mid-generation
        steps(engine, 4)
        assert engine.stats.num_draft_failures == 4  # each step decoded without speculation
        accepted_before_restart = engine.stats.num_accepted
        # Back on the same address with no memory of the sequences: NOT_FOUND, full re-send.
        server, port, drafter = start_drafter(target_model_fp32, warm_datastore, port=port)
        time.sleep(1.2)  # the client's reconnect backoff is at most 1 s
        while engine.has_work():
            engine.step()
        assert engine.stats.num_draft_failures >= 4
        assert engine.stats.num_accepted > accepted_before_restart  # speculation resumed
        for seq, index in zip(sequences, (0, 2, 3)):
            assert seq.output_ids == greedy_references[index][:MAX_TOKENS]
        assert drafter.num_sequences == 0  # finished sequences were ended on the new drafter
    finally:
        remote.close()
        stop_drafter(server, drafter)


class SlowDrafter(LocalDrafter):
    """A real drafter that answers after the client's deadline."""

    def propose(self, requests):
        time.sleep(0.25)
        return super().propose(requests)


def test_drafter_past_its_deadline_is_skipped(engine_factory, target_model_fp32,
                                              mt_bench_prompts, greedy_references):
    config = DrafterConfig(vocab_size=target_model_fp32.vocab_size, host="127.0.0.1", port=0,
                           tokenizer_fingerprint=target_model_fp32.fingerprint, num_threads=1)
    slow = SlowDrafter(config)
    slow.start()
    server, port, _ = create_server(config, slow)
    remote = RemoteDrafter(f"127.0.0.1:{port}", timeout_s=0.05)
    engine, _ = engine_factory(2, proposer=remote, max_budget=8)
    try:
        (seq,) = [engine.add_request(GenerateRequest(mt_bench_prompts[1], 12))]
        while engine.has_work():
            engine.step()
        assert seq.output_ids == greedy_references[1][:12]
        assert engine.stats.num_draft_failures == engine.stats.num_steps > 0
        assert engine.stats.draft_s < 0.25 * engine.stats.num_steps  # it did not wait
    finally:
        remote.close()
        stop_drafter(server, slow)


def test_unreachable_drafter_fails_no_request(engine_factory, mt_bench_prompts,
                                              greedy_references):
    with socket.socket() as probe:  # a free port with nobody listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    remote = RemoteDrafter(f"127.0.0.1:{port}", timeout_s=0.2)
    engine, _ = engine_factory(1, proposer=remote, max_budget=8)
    try:
        outputs = engine.generate([mt_bench_prompts[5]], 10)
        assert outputs == [greedy_references[5][:10]]
        assert engine.stats.num_draft_failures == engine.stats.num_steps
    finally:
        remote.close()
