"""Penalties, logit bias, min_tokens, stop_token_ids, min_p and log-probabilities at draft-tree
nodes: the adjusted rows against a from-scratch reference, the tree walk's distribution under
them (statistically), and on the real model (float32) answers and log-probabilities that are
the same with and without speculation."""

import math

import pytest
import torch

from sssd.common.data.corpus import conversation_token_ids
from sssd.verifier.engine import GenerateRequest, SamplingParams
from sssd.verifier.engine.acceptance import accept_at_positions
from sssd.verifier.engine.logits_processing import node_paths, process_tree_logits
from sssd.verifier.engine.sampling import target_probs

VOCAB = 12
EOS = 11


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def reference_row(logits, request, history, eos_ids):
    """One row adjusted by the definitions, from the whole history (answer + path)."""
    row = logits.clone()
    params = request.sampling
    for token in set(history):
        count = history.count(token)
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    if params.repetition_penalty != 1:
        for token in set(history) | set(request.prompt_ids):
            value = row[token]
            row[token] = value / params.repetition_penalty if value > 0 \
                else value * params.repetition_penalty
    for token, bias in params.logit_bias:
        row[token] += bias
    if len(history) < request.min_tokens:
        for token in set(request.stop_token_ids) | set(eos_ids):
            row[token] = float("-inf")
    return row


# A tree over a small vocabulary: root 0, chains 0-1-2-4 and 0-3 (tokens repeat on a path).
PARENTS = [-1, 0, 1, 0, 2]
TOKENS = [5, 2, 2, 7, 3]


@pytest.mark.parametrize("params, extra", [
    (dict(frequency_penalty=1.5), {}),
    (dict(presence_penalty=-1.0, frequency_penalty=0.5), {}),
    (dict(repetition_penalty=1.7), {}),
    (dict(logit_bias=((4, 3.0), (2, -100.0))), {}),
    (dict(presence_penalty=0.7), dict(min_tokens=5, stop_token_ids=(9,))),
])
def test_each_node_is_adjusted_by_its_own_path(params, extra):
    torch.manual_seed(0)
    logits = torch.randn(len(PARENTS), VOCAB) * 3
    output = [2, 6, 6]
    request = GenerateRequest((1, 3, 8), 16, SamplingParams(temperature=1.0, **params), **extra)
    adjusted = logits.clone()
    process_tree_logits(adjusted, request, output, PARENTS, TOKENS, {EOS})
    for node, path in enumerate(node_paths(PARENTS, TOKENS)):
        expected = reference_row(logits[node], request, output + path, {EOS})
        torch.testing.assert_close(adjusted[node], expected)


def test_min_tokens_masks_only_the_nodes_still_short():
    logits = torch.zeros(len(PARENTS), VOCAB)
    request = GenerateRequest((1,), 16, SamplingParams(), min_tokens=3, stop_token_ids=(9,))
    process_tree_logits(logits, request, [4], PARENTS, TOKENS, {EOS})
    depths = [len(p) for p in node_paths(PARENTS, TOKENS)]
    for node, depth in enumerate(depths):
        masked = 1 + depth < 3  # the answer's length before this node's next token
        assert math.isinf(logits[node, EOS]) == masked and math.isinf(logits[node, 9]) == masked
        assert not math.isinf(logits[node, 0])


def test_the_tree_walk_draws_the_penalized_distribution_after_an_accepted_node():
    """A node's next token follows the distribution adjusted with its ancestors: the second
    emitted token's frequencies over many seeds match the reference row (chi-square)."""
    torch.manual_seed(1)
    base = torch.randn(VOCAB)
    logits = base.expand(len(PARENTS), VOCAB).clone()
    logits[0, 2] = 12.0  # the root's next token is almost surely 2: node 1 gets accepted
    request = GenerateRequest((1,), 16, SamplingParams(temperature=1.0, frequency_penalty=2.0,
                                                       presence_penalty=1.0))
    output = [2]
    adjusted = logits.clone()
    process_tree_logits(adjusted, request, output, PARENTS, TOKENS, {EOS})
    probs = target_probs(adjusted, request.sampling)
    counts = torch.zeros(VOCAB)
    num_accepted_first = 0
    for seed in range(4000):
        result = accept_at_positions(TOKENS, PARENTS, probs, seed, first_position=1)
        emitted = result.emitted_tokens
        if emitted[0] == 2 and len(emitted) > 1:
            num_accepted_first += 1
            counts[emitted[1]] += 1
    assert num_accepted_first > 3500
    # After the path [2] the answer is [2, 2]: the reference row counts token 2 twice.
    expected = torch.softmax(reference_row(base, request, output + [2], {EOS}), dim=-1)
    expected_counts = (expected * counts.sum()).numpy()
    keep = expected_counts > 5
    observed = counts.numpy()[keep]
    expected_counts = expected_counts[keep] * observed.sum() / expected_counts[keep].sum()
    statistic = float(((observed - expected_counts) ** 2 / expected_counts).sum())
    assert chi2_sf(statistic, len(observed) - 1) > 1e-3
    assert counts[2] < 0.02 * counts.sum()  # penalized away, though the base favours it less


def test_min_p_drops_the_tail_relative_to_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert probs[0, 3] == 0 and probs[0, 2] > 0  # 0.05 < 0.2 * 0.5 <= 0.15
    torch.testing.assert_close(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def run(engine, prompts, sampling, speculate, **extra):
    sequences = [engine.add_request(GenerateRequest(tuple(p), 24, sampling, speculate=speculate,
                                                    **extra)) for p in prompts]
    while engine.has_work():
        engine.step()
    return sequences


def collect_logprobs(engine, prompts, sampling, speculate):
    """Output ids and each token's logprob entries, from the step outputs."""
    by_id = {}
    sequences = [engine.add_request(GenerateRequest(tuple(p), 24, sampling, speculate=speculate))
                 for p in prompts]
    while engine.has_work():
        for row in engine.step().rows:
            by_id.setdefault(row.request_id, []).extend(row.logprobs)
    return [(s.output_ids, by_id[s.request_id]) for s in sequences]


def test_logprobs_are_the_same_with_and_without_speculation(engine_factory, mt_bench_prompts,
                                                            warm_datastore):
    prompts = [mt_bench_prompts[i] for i in (0, 3)]
    sssd, drafter = engine_factory(2, warm_datastore)
    try:
        for sampling in (SamplingParams(logprobs=5),
                         SamplingParams(temperature=0.8, seed=7, logprobs=3)):
            plain = collect_logprobs(sssd, prompts, sampling, speculate=False)
            speculated = collect_logprobs(sssd, prompts, sampling, speculate=True)
            for (ids, entries), (spec_ids, spec_entries) in zip(plain, speculated):
                assert spec_ids == ids and len(entries) == len(ids) == len(spec_entries)
                for entry, spec_entry, token in zip(entries, spec_entries, ids):
                    assert entry.token_id == spec_entry.token_id == token
                    assert spec_entry.logprob == pytest.approx(entry.logprob, abs=1e-4)
                    assert len(entry.top) == sampling.logprobs
                    assert [t for t, _ in spec_entry.top] == [t for t, _ in entry.top] or \
                        max(abs(a - b) for (_, a), (_, b) in zip(entry.top, entry.top[1:])) < 1e-3
                    assert entry.top[0][1] >= entry.logprob - 1e-6
                if sampling.is_greedy:  # the emitted token is the most likely one
                    assert all(e.top[0][0] == e.token_id for e in entries)
        assert sssd.stats.num_accepted > 0
    finally:
        drafter.close()


@pytest.mark.parametrize("params, extra", [
    (dict(frequency_penalty=2.0, presence_penalty=1.0), {}),
    (dict(repetition_penalty=1.5), {}),
    (dict(logit_bias=((198, -100.0),), min_p=0.1), dict(min_tokens=20)),  # 198: a line break
])
def test_adjusted_answers_are_the_same_with_and_without_speculation(
        engine_factory, target_model_fp32, mt_bench_prompts, warm_datastore, params, extra):
    # A list repeats its tokens: every adjustment changes its answer.
    listing = conversation_token_ids(target_model_fp32.tokenizer, [
        {"role": "user", "content": "Write a list of ten fruits, one per line."}], True)
    prompts = [listing, mt_bench_prompts[1]]
    sssd, drafter = engine_factory(2, warm_datastore)
    try:
        for sampling in (SamplingParams(**params),
                         SamplingParams(temperature=0.9, seed=11, **params)):
            plain = [s.output_ids for s in run(sssd, prompts, sampling, False, **extra)]
            speculated = [s.output_ids for s in run(sssd, prompts, sampling, True, **extra)]
            assert speculated == plain
            unadjusted = [s.output_ids for s in run(
                sssd, prompts, SamplingParams(temperature=sampling.temperature,
                                              seed=sampling.seed), False)]
            assert unadjusted != plain  # the adjustment changed the answers
        assert sssd.stats.num_accepted > 0
    finally:
        drafter.close()


def test_stop_token_ids_end_the_answer_and_min_tokens_holds_them_off(engine_factory,
                                                                      mt_bench_prompts):
    plain, _ = engine_factory(1, proposer=None)
    prompt = mt_bench_prompts[0]
    free = run(plain, [prompt], SamplingParams(), False)[0].output_ids
    stop = free[5]
    first = free.index(stop)
    stopped = run(plain, [prompt], SamplingParams(), False, stop_token_ids=(stop,))[0]
    assert stopped.output_ids == free[:first + 1] and stopped.finish_reason == "stop"
    held = run(plain, [prompt], SamplingParams(), False, stop_token_ids=(stop,),
               min_tokens=first + 2)[0]
    assert stop not in held.output_ids[:first + 2]
