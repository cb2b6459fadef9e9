"""Resuming an answer another worker began (failover, serving/ray_backend.py): the engine takes
the tokens already streamed as its output so far and goes on exactly as if it had made them."""

import pytest

from sssd.verifier.engine import GenerateRequest, SamplingParams
from sssd.verifier.engine.request import InvalidRequest, RequestLimits

MAX_TOKENS = 32


def run(engine, requests):
    sequences = [engine.add_request(request) for request in requests]
    while engine.has_work():
        engine.step()
    return sequences


def test_a_resumed_answer_goes_on_exactly(engine_factory, mt_bench_prompts, greedy_references,
                                          warm_datastore):
    engine, drafter = engine_factory(3, warm_datastore)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    try:
        (sampled,) = run(engine, [GenerateRequest(tuple(mt_bench_prompts[4]), MAX_TOKENS,
                                                  sampling)])
        cases = [(mt_bench_prompts[0], greedy_references[0][:MAX_TOKENS], SamplingParams(), 1),
                 (mt_bench_prompts[3], greedy_references[3][:MAX_TOKENS], SamplingParams(), 20),
                 (mt_bench_prompts[4], sampled.output_ids, sampling, 9)]
        sequences = run(engine, [GenerateRequest(tuple(prompt), MAX_TOKENS, params,
                                                 resume_ids=tuple(answer[:done]))
                                 for prompt, answer, params, done in cases])
    finally:
        drafter.close()
    for seq, (_, answer, _, done) in zip(sequences, cases):
        assert seq.output_ids == answer  # the resumed tokens, then exactly what follows
        assert seq.num_resumed == done and seq.finish_reason == "length"
    assert engine.stats.num_accepted > 0  # the drafter saw prompt + resumed answer


def test_resume_fields_are_checked():
    limits = RequestLimits.for_context(vocab_size=100, max_len=16)
    with pytest.raises(InvalidRequest, match="resume: 4 tokens already generated, max_tokens 4"):
        GenerateRequest((1, 2), 4, resume_ids=(5, 6, 7, 8))
    with pytest.raises(InvalidRequest, match="resume: token ids must be integers"):
        GenerateRequest((1, 2), 4, resume_ids=(5, "x"))
    with pytest.raises(InvalidRequest, match="resume: text characters"):
        GenerateRequest((1, 2), 4, resume_ids=(5,), resume_text_chars=-1)
    with pytest.raises(InvalidRequest, match="resume: a token id is outside the vocabulary"):
        limits.check(GenerateRequest((1, 2), 4, resume_ids=(100,)))
    with pytest.raises(InvalidRequest, match="resume: prompt and answer hold 15 tokens"):
        limits.check(GenerateRequest((1,) * 10, 8, resume_ids=(3,) * 5))
    request = GenerateRequest((1, 2), 4, resume_ids=(5,))
    limits.check(request)
    assert request.context_ids == (1, 2, 5)
