"""The engine on its paged KV cache: a prefix found in the cache gives the same tokens as one
computed afresh (a conversation's earlier turns, answers included), long prompts are prefilled
in chunks between the other sequences' decode steps, a full cache preempts the youngest
sequence instead of failing a request, and concurrency is bounded by memory, not slots."""

import pytest

from sssd.drafter.config import DrafterConfig
from sssd.drafter.drafter import LocalDrafter
from sssd.verifier.engine import Engine
from sssd.verifier.engine.budget_policy import RuleBudget
from sssd.verifier.engine.model_runner import ModelRunner
from sssd.verifier.engine.request import GenerateRequest, InvalidRequest

pytestmark = pytest.mark.model


def paged_engine(loaded, max_batch_size=4, num_blocks=None, max_len=1024, chunk=512,
                 caching=True, speculate=True):
    runner = ModelRunner(loaded.model, max_seqs=max_batch_size, max_len=max_len,
                         num_blocks=num_blocks)
    drafter = None
    if speculate:  # the input trie alone: trees that repeat the prompt
        drafter = LocalDrafter(DrafterConfig(vocab_size=loaded.vocab_size, num_threads=1))
        drafter.start()
    return Engine(runner, loaded.eos_token_ids, RuleBudget(32.0, 8), drafter,
                  max_batch_size=max_batch_size, max_num_batched_tokens=chunk,
                  enable_prefix_caching=caching)


def run(engine, requests):
    """Adds the requests, steps until done; returns each one's output ids."""
    sequences = [engine.add_request(request) for request in requests]
    while engine.has_work():
        engine.step()
    return [seq.output_ids for seq in sequences]


def turns(tokenizer, *messages):
    from sssd.common.data.corpus import conversation_token_ids

    return tuple(conversation_token_ids(tokenizer, [
        {"role": role, "content": text} for role, text in messages],
        add_generation_prompt=True))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_conversation_served_from_the_prefix_cache_gives_the_same_tokens(
        dtype, target_model_fp32, target_model_bf16, mt_bench_prompts):
    """Turn two of a conversation holds turn one's prompt and its answer: served after turn
    one, most of it (answer included, whose keys and values were decoded in draft trees) comes
    from the prefix cache, and its answer is token for token the answer of an engine that
    computes it all."""
    loaded = target_model_fp32 if dtype == "fp32" else target_model_bf16
    tokenizer = loaded.tokenizer
    question = "Explain, with an example, how a hash map handles collisions."
    first = turns(tokenizer, ("user", question))
    cached = paged_engine(loaded)
    try:
        (answer,) = run(cached, [GenerateRequest(first, 40)])
        reply = tokenizer.decode(answer, skip_special_tokens=True)
        second = turns(tokenizer, ("user", question), ("assistant", reply),
                       ("user", "Now do the same for open addressing."))
        hits_before = cached.blocks.stats.hits
        (with_hits,) = run(cached, [GenerateRequest(second, 40)])
        hit = cached.blocks.stats.hits - hits_before
    finally:
        cached.close()
    fresh = paged_engine(loaded, caching=False)
    try:
        (without,) = run(fresh, [GenerateRequest(second, 40)])
    finally:
        fresh.close()
    assert with_hits == without
    # turn one's prompt and most of its answer came from the cache (whole blocks only)
    assert hit >= len(first) + len(answer) - 2 * cached.blocks.block_size


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(target_model_fp32,
                                                                  mt_bench_prompts):
    """A prompt of several chunks enters while another sequence decodes: that one gets tokens
    in every step of the prefill, and the long prompt's answer is the one a single-chunk
    prefill gives."""
    long_prompt = tuple(mt_bench_prompts[0]) * 5  # about 300 tokens
    short = GenerateRequest(tuple(mt_bench_prompts[1]), 48)
    engine = paged_engine(target_model_fp32, chunk=32, speculate=False)
    try:
        decoding = engine.add_request(short)
        for _ in range(3):
            engine.step()
        waiting = engine.add_request(GenerateRequest(long_prompt, 16))
        steps_prefilling, tokens_meanwhile = 0, 0
        while not waiting.is_prefilled:
            before = len(decoding.output_ids)
            engine.step()
            steps_prefilling += 1
            tokens_meanwhile += len(decoding.output_ids) > before
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    assert steps_prefilling >= len(long_prompt) // 32  # chunk by chunk
    assert tokens_meanwhile == steps_prefilling  # the decoding sequence never waited
    whole = paged_engine(target_model_fp32, chunk=1024, speculate=False)
    try:
        assert run(whole, [GenerateRequest(long_prompt, 16)]) == [waiting.output_ids]
    finally:
        whole.close()


@pytest.mark.parametrize("chunk", [512, 64])
def test_choices_of_one_prompt_prefill_it_once(chunk, target_model_fp32, mt_bench_prompts):
    """Four seeded samples of one prompt arriving together (an API request with n = 4): the
    first computes the prompt, in one chunk or several, while the others wait for its blocks
    and take them from the prefix cache; each answer is the one an engine without a prefix
    cache samples with its seed. A different prompt arriving with them does not wait."""
    from sssd.verifier.engine.request import SamplingParams

    prompt = tuple(mt_bench_prompts[0]) * 3  # about 180 tokens: several chunks of 64
    # no chat template: nothing in common with the prompt (a shared system prompt would be)
    other = tuple(target_model_fp32.tokenizer.encode(
        "Write a short poem about the sea and the ships that sail on it."))
    requests = [GenerateRequest(prompt, 12, SamplingParams(temperature=1.0, seed=7 + i))
                for i in range(4)] + [GenerateRequest(other, 12, ignore_eos=True)]
    engine = paged_engine(target_model_fp32, max_batch_size=5, chunk=chunk)
    try:
        sequences = [engine.add_request(request) for request in requests]
        engine.step()
        first_tokens = [len(seq.output_ids) for seq in sequences]
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    shared = (len(prompt) - 1) // 16 * 16  # the prompt's full blocks before its last token
    assert [seq.num_cached_tokens for seq in sequences[:4]] == [0] + [shared] * 3
    assert engine.stats.num_prefill_tokens == len(prompt) + 3 * (len(prompt) - shared) + len(other)
    # the first step: where the step's token budget holds the whole prompt, the first choice's
    # and the other prompt's, which does not wait for the choices' blocks
    fits = int(chunk > len(prompt) + len(other))
    assert first_tokens == [fits] + [0] * 3 + [fits]
    fresh = paged_engine(target_model_fp32, max_batch_size=5, caching=False)
    try:
        assert run(fresh, requests) == [seq.output_ids for seq in sequences]
    finally:
        fresh.close()
    # without the cache: no waiting
    assert fresh.stats.num_prefill_tokens == 4 * len(prompt) + len(other)
    assert len({tuple(seq.output_ids) for seq in sequences[:4]}) > 1  # seeds differ


def test_a_full_cache_preempts_the_youngest_and_every_request_completes(
        target_model_fp32, mt_bench_prompts, greedy_references):
    """A cache that admits three of four requests but cannot grow all three to their answers'
    ends: sequences are preempted and computed again when blocks free up (their full blocks
    from the prefix cache), and every answer is plain greedy decoding's."""
    from sssd.verifier.engine.scheduler import CHUNK_PADDING

    new = len(greedy_references[0])
    requests = [GenerateRequest(tuple(mt_bench_prompts[i]), new) for i in range(4)]
    # Exactly the blocks the first three take on admission (a prompt and its chunk's padding):
    # the first of them to need one more preempts the youngest.
    admitted = sum(-(-(len(r.prompt_ids) + CHUNK_PADDING) // 16) for r in requests[:3])
    engine = paged_engine(target_model_fp32, num_blocks=admitted)
    try:
        outputs = run(engine, requests)
        preemptions = engine.scheduler.num_preemptions
        free = engine.blocks.num_free
    finally:
        engine.close()
    assert preemptions > 0
    assert outputs == [greedy_references[i] for i in range(4)]
    assert free == engine.blocks.num_blocks  # every block back (cached ones evictable)


def test_a_prompt_longer_than_the_window_is_refused_with_both_numbers(target_model_fp32):
    engine = paged_engine(target_model_fp32, max_len=128, speculate=False)
    try:
        with pytest.raises(InvalidRequest, match=r"prompt: 200 tokens, the context window of 128 "
                           r"positions allows at most 126"):
            engine.add_request(GenerateRequest(tuple(range(10, 210)), 8))
    finally:
        engine.close()


def test_sixty_four_streams_run_at_once(target_model_fp32, mt_bench_prompts):
    """Concurrency is bounded by the cache's memory: 64 sequences run in one batch."""
    engine = paged_engine(target_model_fp32, max_batch_size=64, speculate=False)
    try:
        sequences = [engine.add_request(GenerateRequest(tuple(mt_bench_prompts[i % 8]), 4))
                     for i in range(64)]
        most = 0
        while engine.has_work():
            engine.step()
            most = max(most, engine.num_running)
    finally:
        engine.close()
    assert most == 64
    assert all(len(seq.output_ids) == 4 for seq in sequences)
    assert len({tuple(seq.output_ids) for seq in sequences}) <= 8  # the same prompts, greedy
