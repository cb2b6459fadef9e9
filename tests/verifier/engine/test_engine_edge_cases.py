"""Stops and failures inside accepted paths: EOS, max_tokens, stop strings, drafter outages."""

import numpy as np
import pytest
import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.drafting.proposer import SequenceNotFound
from sssd.verifier.engine import GenerateRequest


class OracleDrafter:
    """Drafts the known greedy continuation as a chain, plus a wrong first-level branch, so that
    whole chains get accepted and stops land inside accepted paths."""

    sources = ("sssd",)
    hindsight_drafts = False

    def __init__(self, prompts, references):
        self.prompts = prompts
        self.references = references
        self.contexts = {}
        self.calls = 0
        self.ended = []

    def propose(self, requests):
        self.calls += 1
        # Like the real drafter: every unknown id is reported, and nothing changes.
        missing = [r.seq_id for r in requests if not r.is_start and r.seq_id not in self.contexts]
        if missing:
            raise SequenceNotFound(missing)
        trees = []
        for request in requests:
            if request.is_start:
                self.contexts[request.seq_id] = list(request.token_ids)
            else:
                self.contexts[request.seq_id] += list(request.token_ids)
            index = int(request.seq_id)
            context = self.contexts[request.seq_id]
            done = len(context) - len(self.prompts[index])
            chain = self.references[index][done : done + request.budget - 2]
            wrong = (context[-1] + 1) % 1000
            tokens = [context[-1], wrong] + chain
            parents = [-1, 0] + [0] + list(range(2, 1 + len(chain)))
            tokens, parents = tokens[: len(parents)], parents[: len(tokens)]
            trees.append(DraftTree(np.array(tokens, np.int32), np.array(parents, np.int32)))
        return trees

    def end(self, seq_ids):
        self.ended += list(seq_ids)
        return sum(self.contexts.pop(seq_id, None) is not None for seq_id in seq_ids)

    def stats(self):
        return {}

    def close(self):
        pass


def run(engine, prompts, indices, max_tokens, stops=()):
    sequences = [engine.add_request(GenerateRequest(
        prompts[i], max_tokens[k] if isinstance(max_tokens, list) else max_tokens, stop=stops),
        request_id=str(i)) for k, i in enumerate(indices)]
    while engine.has_work():
        engine.step()
    return sequences


@pytest.fixture
def oracle(mt_bench_prompts, greedy_references):
    return OracleDrafter(mt_bench_prompts, greedy_references)


def test_eos_inside_an_accepted_path_ends_the_sequence(engine_factory, target_model_fp32):
    tokenizer, model = target_model_fp32.tokenizer, target_model_fp32.model
    eos = set(target_model_fp32.eos_token_ids)
    prompts = []
    for question in ("What is the capital of France? Answer in one sentence.",
                     "Say hello in one word."):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    with torch.inference_mode():
        references = [model.generate(torch.tensor([p]), do_sample=False,
                                     max_new_tokens=40)[0, len(p):].tolist() for p in prompts]
    assert all(ref[-1] in eos for ref in references), "these short answers end with EOS"
    # The oracle drafts past the end: EOS lands inside an accepted chain, junk follows it.
    oracle = OracleDrafter(prompts, [ref + [13, 14, 15] for ref in references])
    engine, _ = engine_factory(2, proposer=oracle, max_budget=12)
    sequences = run(engine, prompts, [0, 1], 40)
    for seq, reference in zip(sequences, references):
        assert seq.output_ids == reference
        assert seq.finish_reason == "stop"
    assert engine.stats.mean_accepted_per_step > 2  # whole chains were accepted


def test_max_tokens_cuts_an_accepted_path(engine_factory, oracle, mt_bench_prompts,
                                          greedy_references, target_model_fp32):
    eos = set(target_model_fp32.eos_token_ids)
    engine, _ = engine_factory(4, proposer=oracle, max_budget=12)
    limits = [5, 13, 1, 40]
    sequences = run(engine, mt_bench_prompts, [0, 1, 2, 3], limits)
    for seq, index, limit in zip(sequences, [0, 1, 2, 3], limits):
        expected = greedy_references[index][:limit]
        assert seq.output_ids == expected
        assert seq.finish_reason == ("stop" if eos & set(expected) else "length")
    # Sequences finished at different steps while the others went on.
    assert oracle.ended and len(set(oracle.ended)) == 4


def test_stop_string_spanning_two_steps(engine_factory, mt_bench_prompts, greedy_references,
                                        target_model_fp32):
    tokenizer = target_model_fp32.tokenizer
    reference = greedy_references[0]
    # The text of tokens 6 and 7: without speculation each token is its own step.
    first, second = tokenizer.decode(reference[6:7]), tokenizer.decode(reference[7:8])
    stop = first[-2:] + second[:2] if len(first) >= 2 and len(second) >= 2 else first + second
    engine, _ = engine_factory(1, proposer=None)
    (seq,) = run(engine, mt_bench_prompts, [0], 64, stops=(stop,))
    text = tokenizer.decode(seq.output_ids)
    assert seq.finish_reason == "stop"
    assert seq.output_ids == reference[: len(seq.output_ids)]
    assert stop in text and stop not in tokenizer.decode(seq.output_ids[:-1])
    assert text[: seq.stop_text_len] + stop == text[: seq.stop_text_len + len(stop)]


class FlakyDrafter(OracleDrafter):
    """Fails some calls as a dead drafter would; forgets everything once, as a restart would."""

    def __init__(self, prompts, references, failing_calls, restart_call):
        super().__init__(prompts, references)
        self.failing_calls = failing_calls
        self.restart_call = restart_call

    def propose(self, requests):
        if self.calls + 1 in self.failing_calls:
            self.calls += 1
            raise ConnectionError("drafter unavailable")
        if self.calls + 1 == self.restart_call:
            self.contexts.clear()
        return super().propose(requests)


def test_drafter_outage_and_restart_lose_nothing(engine_factory, mt_bench_prompts,
                                                 greedy_references):
    drafter = FlakyDrafter(mt_bench_prompts, greedy_references, failing_calls={3, 4, 5},
                           restart_call=8)
    engine, _ = engine_factory(3, proposer=drafter, max_budget=8)
    sequences = run(engine, mt_bench_prompts, [4, 5, 6], 48)
    for seq, index in zip(sequences, [4, 5, 6]):
        assert seq.output_ids == greedy_references[index][:48]
    assert engine.stats.num_draft_failures == 3
    assert engine.stats.num_accepted > 0  # speculation resumed after the outage and restart


class ForeignDrafter(OracleDrafter):
    """Drafts the right continuation with one token id past the model's vocabulary, as a
    drafter serving a datastore of another tokenizer would."""

    def __init__(self, prompts, references, vocab_size):
        super().__init__(prompts, references)
        self.vocab_size = vocab_size

    def propose(self, requests):
        trees = super().propose(requests)
        for tree in trees:
            tree.token_ids[-1] = self.vocab_size + 5
        return trees


def test_a_token_outside_the_vocabulary_is_a_drafter_failure_not_a_crash(
        engine_factory, mt_bench_prompts, greedy_references, target_model_fp32):
    drafter = ForeignDrafter(mt_bench_prompts, greedy_references, target_model_fp32.vocab_size)
    engine, _ = engine_factory(2, proposer=drafter, max_budget=8)
    sequences = run(engine, mt_bench_prompts, [4, 5], 16)
    for seq, index in zip(sequences, [4, 5]):
        assert seq.output_ids == greedy_references[index][:16]
    assert engine.stats.num_draft_failures == engine.stats.num_steps > 0  # every step fell back
    assert engine.stats.num_accepted == 0


def test_a_step_that_admits_runs_one_forward_pass_and_teaches_the_policy_nothing(
        engine_factory, mt_bench_prompts, greedy_references):
    """Three prompts, two running at once: the third is admitted while the others decode, and
    its prompt rides in their verification pass. Outputs stay those of plain greedy decoding."""
    engine, _ = engine_factory(2, proposer=None)
    passes, observed = [], []
    runner_pass, policy_observe = engine.runner.forward, engine.budget_policy.observe

    def forward(trees, chunks):
        passes.append((len(trees), [len(chunk.token_ids) for chunk in chunks]))
        return runner_pass(trees, chunks)

    def observe(batch_size, budget, accepted_nodes, step_s, rows=None):
        observed.append((len(passes), step_s))
        policy_observe(batch_size, budget, accepted_nodes, step_s)

    engine.runner.forward, engine.budget_policy.observe = forward, observe
    sequences = [engine.add_request(GenerateRequest(tuple(prompt), max_tokens))
                 for prompt, max_tokens in zip(mt_bench_prompts[:3], (6, 20, 12))]
    num_steps = 0
    while engine.has_work():
        engine.step()
        num_steps += 1
    assert len(passes) == num_steps  # one pass per step
    lengths = [len(prompt) for prompt in mt_bench_prompts[:3]]
    assert passes[0] == (0, lengths[:2])  # both first prompts in one pass
    mixed = [i for i, (num_trees, chunks) in enumerate(passes) if num_trees and chunks]
    assert len(mixed) == 1 and passes[mixed[0]][0] == 1  # the third beside the second
    # ... less the blocks of its chat template the first two left in the prefix cache
    (third,) = passes[mixed[0]][1]
    assert 0 < third <= lengths[2] and (lengths[2] - third) % engine.blocks.block_size == 0
    for after_pass, step_s in observed:
        assert (step_s is None) == (after_pass - 1 in mixed)
    for seq, reference, max_tokens in zip(sequences, greedy_references, (6, 20, 12)):
        assert seq.output_ids == reference[:max_tokens]


def test_rows_without_speculation_teach_the_policy_only_what_they_ran(
        engine_factory, oracle, mt_bench_prompts, greedy_references):
    """Requests with speculation off beside speculating ones: a step teaches the policy the
    budget its rows were verified at (1 when none drafted, which prices a plain step), the
    acceptance of the rows that drafted, and its time only when every row ran that budget.
    Before, an all-off batch was timed as a step of the policy's budget (a tree's cost learned
    at a plain step's) and its empty paths taught that budget zero acceptance."""
    engine, _ = engine_factory(2, proposer=oracle, max_budget=8)
    observed = []
    policy_observe = engine.budget_policy.observe

    def observe(batch_size, budget, accepted_nodes, step_s, rows=None):
        observed.append((batch_size, budget, [list(p) for p in accepted_nodes], step_s,
                         list(rows or [])))
        policy_observe(batch_size, budget, accepted_nodes, step_s, rows)

    engine.budget_policy.observe = observe
    requests = [GenerateRequest(tuple(mt_bench_prompts[i]), 16, speculate=speculate)
                for i, speculate in ((0, False), (1, False), (2, True))]
    off = [engine.add_request(request, request_id=str(i))
           for i, request in enumerate(requests[:2])]
    while engine.has_work():
        engine.step()
    all_off = list(observed)
    assert all_off and all(budget == 1 and step_s is not None and rows == ["0", "1"] and
                           paths == [[], []] for _, budget, paths, step_s, rows in all_off)
    observed.clear()
    mixed = [engine.add_request(requests[0], request_id="0"),
             engine.add_request(requests[2], request_id="2")]
    while engine.has_work():
        engine.step()
    two_rows = [entry for entry in observed if entry[0] == 2]
    assert two_rows and all(budget == 8 and step_s is None and rows == ["2"] and len(paths) == 1
                            for _, budget, paths, step_s, rows in two_rows)
    assert any(paths[0] for _, _, paths, _, _ in two_rows)  # the oracle's chains were accepted
    for seq, index in zip(off + mixed, (0, 1, 0, 2)):
        assert seq.output_ids == greedy_references[index][:16]
