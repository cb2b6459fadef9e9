"""The speculator's core in process, with the engine (float32, the real model): exact greedy and
seeded output, the speculation cache, and the round protocol's checks."""

import pytest

from sssd.common.drafting.proposer import CapacityError, SequenceNotFound
from sssd.speculator.client import SpeculatorProposer
from sssd.speculator.protocol import FingerprintMismatch, RoundInput
from sssd.verifier.engine import GenerateRequest, SamplingParams

MAX_TOKENS = 16
PROMPTS = (0, 3, 5, 7)  # indices into mt_bench_prompts
# (batch size, prompts): one prompt at a time, and all four in one batch.
BATCHES = [(1, 2), (4, 4)]
CHEAP_BATCHES = [(1, 1), (4, 4)]  # the 8-layer draft misses often: each miss drafts in line


def generate(engine, prompts, batch_size, sampling=None):
    """Greedy (or `sampling`) answers, `batch_size` prompts at a time."""
    answers = []
    for first in range(0, len(prompts), batch_size):
        sequences = [engine.add_request(GenerateRequest(
            tuple(p), MAX_TOKENS, sampling or SamplingParams()))
            for p in prompts[first:first + batch_size]]
        while engine.has_work():
            engine.step()
        answers += [s.output_ids for s in sequences]
    return answers


def exact_ssd_run(make_speculator, engine_factory, loaded, mt_bench_prompts, greedy_references,
                  draft_layers, fanout_budget, batch_size, num_prompts):
    """Greedy answers through an in-process speculator (K = 3, b* = 8) must equal plain greedy
    decoding; returns the speculator's and the engine's statistics."""
    speculator = make_speculator(draft_layers, lookahead=3, fanout_budget=fanout_budget,
                                 critical_batch_size=8)
    engine, _ = engine_factory(4, proposer=SpeculatorProposer(speculator,
                                                              fingerprint=loaded.fingerprint),
                               max_budget=4)
    try:
        indices = PROMPTS[:num_prompts]
        answers = generate(engine, [mt_bench_prompts[i] for i in indices], batch_size)
        assert answers == [greedy_references[i][:MAX_TOKENS] for i in indices]
        return speculator.stats, engine.stats
    finally:
        engine.close()


@pytest.mark.parametrize("batch_size,num_prompts", BATCHES)
def test_draft_equal_to_target_hits_every_round(batch_size, num_prompts, make_speculator,
                                               engine_factory, target_model_fp32,
                                               mt_bench_prompts, greedy_references):
    """The sharp check of the cache keys and the outcome prediction: with the target as its own
    draft every draft is accepted and every outcome was predicted."""
    stats, engine_stats = exact_ssd_run(make_speculator, engine_factory, target_model_fp32,
                                        mt_bench_prompts, greedy_references, 0, 8, batch_size,
                                        num_prompts)
    # One cold round per sequence (just in time); every later round is a cache hit.
    assert stats.misses_jit == num_prompts and stats.misses_fallback == 0
    assert stats.hits == stats.rows - num_prompts > 0
    # Every verified step accepted all 3 drafts, except where the answer ended.
    assert engine_stats.num_accepted >= 3 * (engine_stats.num_row_steps - 2 * num_prompts)


@pytest.mark.parametrize("batch_size,num_prompts", CHEAP_BATCHES)
def test_cheap_draft_is_exact_with_hits_and_misses(batch_size, num_prompts, make_speculator,
                                                  engine_factory, target_model_fp32,
                                                  mt_bench_prompts, greedy_references):
    stats, _ = exact_ssd_run(make_speculator, engine_factory, target_model_fp32,
                             mt_bench_prompts, greedy_references, 8, 12, batch_size, num_prompts)
    assert stats.hits > 0 and stats.misses_jit > num_prompts  # both paths exercised


def test_misses_above_the_critical_batch_size_fall_back_to_sssd(
        make_speculator, engine_factory, target_model_fp32, mt_bench_prompts,
        greedy_references):
    """b* = 1: at batch 2 every miss is drafted by the fallback (an in-process SSSD drafter
    without datastore); the answers stay exact and the fallback really drafted."""
    from sssd.drafter.config import DrafterConfig
    from sssd.drafter.drafter import LocalDrafter

    fallback = LocalDrafter(DrafterConfig(vocab_size=target_model_fp32.vocab_size, num_threads=1))
    fallback.start()
    speculator = make_speculator(8, lookahead=3, fanout_budget=12, critical_batch_size=1)
    proposer = SpeculatorProposer(speculator, fallback, target_model_fp32.fingerprint)
    engine, _ = engine_factory(2, proposer=proposer, max_budget=8)
    try:
        indices = PROMPTS[:2]
        assert generate(engine, [mt_bench_prompts[i] for i in indices], 2) == \
            [greedy_references[i][:MAX_TOKENS] for i in indices]
        assert speculator.stats.misses_fallback > 0 and speculator.stats.misses_jit == 0
        assert proposer.counters.fallbacks == speculator.stats.misses_fallback
        assert proposer.counters.fallback_errors == 0
    finally:
        engine.close()


def test_seeded_sampling_is_the_same_as_without_speculation(make_speculator, engine_factory,
                                                            target_model_fp32,
                                                            mt_bench_prompts):
    """Sampled drafts (Saguaro, C = 0.5) never change a seeded answer: the verifier's tokens are
    a function of (seed, position)."""
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    prompts = [mt_bench_prompts[i] for i in PROMPTS[:2]]
    plain, _ = engine_factory(2, proposer=None)
    speculator = make_speculator(8, lookahead=3, fanout_budget=8, saguaro_c=0.5,
                                 critical_batch_size=8)
    engine, _ = engine_factory(2, proposer=SpeculatorProposer(speculator), max_budget=4)
    try:
        reference = generate(plain, prompts, 2, sampling)
        assert generate(engine, prompts, 2, sampling) == reference
        assert engine.stats.num_accepted > 0 and speculator.stats.hits > 0
    finally:
        engine.close()
        plain.close()


def context(mt_bench_prompts):
    return list(mt_bench_prompts[1])


def test_a_predicted_outcome_is_served_exactly_as_drafted(make_speculator, mt_bench_prompts):
    """Every prediction of the cache equals what drafting from scratch after that outcome
    gives (the draft model is deterministic at temperature 0): the cache keys, the branch
    positions and the branch masks are right."""
    speculator = make_speculator(8, lookahead=3, fanout_budget=8)
    fresh = make_speculator(8, lookahead=3, fanout_budget=8)
    try:
        prompt = context(mt_bench_prompts)
        drafts = speculator.round([RoundInput("a", prompt, budget=4, is_start=True)])[0].token_ids
        assert len(drafts) == 3
        speculator._wait_for_speculation()
        predictions = dict(speculator._seqs["a"].predictions)
        assert len(predictions) == 8
        assert all(bonus != drafts[k] for k, bonus in predictions if k < 3)
        for n, ((k, bonus), predicted) in enumerate(predictions.items()):
            outcome = prompt + drafts[:k] + [bonus]
            cold = fresh.round([RoundInput(f"f{n}", outcome, budget=4, is_start=True)])[0]
            assert cold.token_ids == predicted.tokens, (k, bonus)
        # A predicted outcome is a hit and serves those tokens.
        (k, bonus), predicted = next(iter(predictions.items()))
        hit = speculator.round([RoundInput("a", drafts[:k] + [bonus], k, budget=4)])[0]
        assert hit.hit and hit.token_ids == predicted.tokens
        # An outcome it did not predict is a miss, drafted just in time.
        speculator._wait_for_speculation()
        unpredicted = next(t for t in range(100, 200)
                           if (0, t) not in speculator._seqs["a"].predictions
                           and t != hit.token_ids[0])
        miss = speculator.round([RoundInput("a", [unpredicted], 0, budget=4)])[0]
        assert not miss.hit and len(miss.token_ids) == 3
    finally:
        speculator.close()
        fresh.close()


def test_bad_rounds_raise_and_change_nothing(make_speculator, mt_bench_prompts,
                                             target_model_fp32):
    speculator = make_speculator(8, lookahead=3, fanout_budget=8, max_sequences=2)
    try:
        prompt = context(mt_bench_prompts)
        drafts = speculator.round([RoundInput("a", prompt, budget=4, is_start=True)])[0].token_ids
        bad = [
            ([], ValueError, "empty batch"),
            ([RoundInput("zz", [1], 0, budget=4)], SequenceNotFound, "zz"),
            ([RoundInput("a", drafts + [5], 4, budget=4)], ValueError, "out of range"),
            ([RoundInput("a", [drafts[0] + 1, 5], 1, budget=4)], ValueError, "accepted drafts"),
            ([RoundInput("a", [10**6], 0, budget=4)], ValueError, "token ids must be in"),
            ([RoundInput("a", [1], 0, budget=4, temperature=-1.0)], ValueError, "temperature"),
            ([RoundInput("b", [], 0, budget=4, is_start=True)], ValueError, "full context"),
            ([RoundInput("a", [1], 0), RoundInput("a", [1], 0)], ValueError, "twice"),
            ([RoundInput(s, [1], 0, is_start=True) for s in "bcd"], CapacityError,
             "max_sequences"),
        ]
        for inputs, error, message in bad:
            with pytest.raises(error, match=message):
                speculator.round(inputs)
        with pytest.raises(FingerprintMismatch, match="tokenizer"):
            speculator.round([RoundInput("a", drafts[:1], 0, budget=4)], fingerprint="other")
        assert speculator.num_sequences == 1 and speculator.stats.rounds == 1
        # The state is as it was: the right outcome still continues the sequence.
        assert len(speculator.round([RoundInput("a", drafts[:2] + [7], 2, budget=4)])[0]
                   .token_ids) == 3
        assert speculator.round([RoundInput("a", [1], 0)], target_model_fp32.fingerprint)
        assert speculator.end(["a", "unknown"]) == 1 and speculator.num_sequences == 0
        speculator.drain()  # shutting down: rounds are refused (UNAVAILABLE over gRPC)
        with pytest.raises(ConnectionError, match="draining"):
            speculator.round([RoundInput("n", [1, 2], budget=4, is_start=True)])
    finally:
        speculator.close()
