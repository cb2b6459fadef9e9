"""A seeded sampled answer is a function of (seed, prompt, settings) alone: the same with
speculation off, prompt lookup and SSSD, and in any batch (float32, the real model)."""

from sssd.verifier.engine import GenerateRequest, SamplingParams

MAX_TOKENS = 24
SAMPLING = dict(temperature=0.8, top_p=0.95)


def run(engine, prompts, seed, speculate=True):
    sequences = [engine.add_request(GenerateRequest(
        tuple(p), MAX_TOKENS, SamplingParams(**SAMPLING, seed=seed + i), speculate=speculate))
        for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in sequences]


def test_seeded_answers_do_not_depend_on_the_drafts(engine_factory, mt_bench_prompts,
                                                    warm_datastore):
    prompts = [mt_bench_prompts[i] for i in (0, 2, 4)]
    plain, _ = engine_factory(1, proposer=None)
    lookup, lookup_drafter = engine_factory(3)  # input trie only
    sssd, sssd_drafter = engine_factory(2, warm_datastore)
    try:
        reference = run(plain, prompts, seed=100)
        assert run(lookup, prompts, seed=100) == reference
        assert run(sssd, prompts, seed=100) == reference
        assert run(sssd, prompts, seed=100, speculate=False) == reference
        # Not vacuous: drafts were accepted, and another seed gives another answer.
        assert sssd.stats.num_accepted > 0 and lookup.stats.num_accepted > 0
        assert run(plain, prompts, seed=200) != reference
    finally:
        lookup_drafter.close()
        sssd_drafter.close()
