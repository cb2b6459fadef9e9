"""Structured output: grammars checked at construction, tree masks and pruning against a
from-scratch reference (a fresh matcher per node fed the node's whole path), and on the real
model answers that match their grammar and are the same with and without speculation, greedy
and seeded."""

import json
import re

import jsonschema
import llguidance
import numpy as np
import pytest
import torch

from sssd.common.data.corpus import conversation_token_ids
from sssd.common.drafting.draft_tree import DraftTree
from sssd.verifier.engine import GenerateRequest, Grammar, InvalidRequest, SamplingParams
from sssd.verifier.engine.constraint import GrammarCompiler

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0},
                         "languages": {"type": "array", "items": {"type": "string"},
                                       "maxItems": 4}}}
RECORD = '{"name": "Ada Lovelace", "age": 36, "languages": ["English", "French"]}'


@pytest.mark.parametrize("kind, spec, choices, field", [
    ("json_schema", '{"type": "foo"}', (), "response_format.json_schema"),
    ("json_schema", "not json", (), "response_format.json_schema"),
    ("json_schema", "[1, 2]", (), "response_format.json_schema"),
    ("json_schema", "", (), "response_format.json_schema"),
    ("regex", "a(b", (), "guided_regex"),
    ("grammar", "root ::= (", (), "guided_grammar"),
    ("choice", "", (), "guided_choice"),
    ("choice", "", ("yes", ""), "guided_choice"),
    ("regex", "x" * 70_000, (), "guided_regex"),
    ("yaml", "a: b", (), "response_format"),
])
def test_a_grammar_llguidance_cannot_build_is_refused_naming_the_field(kind, spec, choices,
                                                                        field):
    with pytest.raises(InvalidRequest) as error:
        Grammar(kind, spec, choices)
    assert str(error.value).startswith(f"{field}:")


@pytest.fixture(scope="module")
def compiler(target_model_fp32):
    return GrammarCompiler(target_model_fp32.tokenizer, target_model_fp32.vocab_size,
                           target_model_fp32.eos_token_ids)


def reference_mask(compiler, grammar, tokens):
    """The mask after `tokens` from a fresh matcher, or None when the grammar rejects them."""
    matcher = llguidance.LLMatcher(compiler.llguidance_tokenizer, grammar.llguidance_grammar,
                                   log_level=0)
    if not matcher.consume_tokens(list(tokens)):
        return None
    bitmask = np.zeros((compiler.vocab_size + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:compiler.vocab_size]
    return torch.from_numpy(bits.astype(bool))


def test_choices_are_matched_literally_and_gbnf_is_translated(compiler, target_model_fp32):
    def takes(grammar, text):
        ids = target_model_fp32.tokenizer.encode(text, add_special_tokens=False)
        return reference_mask(compiler, grammar, ids) is not None

    choice = Grammar("choice", choices=("a.b", "c|d"))
    assert takes(choice, "a.b") and takes(choice, "c|d")
    assert not takes(choice, "axb") and not takes(choice, "cd")  # "." and "|" are literal
    for text in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):  # GBNF and Lark
        assert takes(Grammar("grammar", text), "yes") and not takes(Grammar("grammar", text),
                                                                     "maybe")


def test_tree_masks_and_pruning_equal_a_fresh_matcher_per_node(compiler, target_model_fp32):
    tokenizer = target_model_fp32.tokenizer
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    constraint = compiler.constraint(grammar)
    answer = tokenizer.encode('{"name": "Ada', add_special_tokens=False)
    constraint.advance(answer)
    good = tokenizer.encode(' Lovelace", "age": 3', add_special_tokens=False)
    bad = tokenizer.encode('", "height": 2', add_special_tokens=False)  # not in the schema
    also = tokenizer.encode('", "age', add_special_tokens=False)
    # Root, then three branches: a valid chain, an invalid one (pruned from its bad token on,
    # with what hangs below it), and a valid one with a child hanging off a pruned node.
    token_ids, parents = [answer[-1]], [-1]
    for branch in (good, bad, also):
        parent = 0
        for token in branch:
            token_ids.append(token)
            parents.append(parent)
            parent = len(token_ids) - 1
    tree = DraftTree(np.array(token_ids, dtype=np.int32), np.array(parents, dtype=np.int32))
    pruned, masks = constraint.tree(tree)
    paths = [[]]
    for node in range(1, tree.num_nodes):
        paths.append(paths[parents[node]] + [token_ids[node]])
    kept = [n for n in range(tree.num_nodes)
            if reference_mask(compiler, grammar, answer + paths[n]) is not None]
    assert 0 < len(kept) < tree.num_nodes and len(kept) >= 1 + len(good) + len(also)
    assert pruned.token_ids.tolist() == [token_ids[n] for n in kept]
    assert masks.shape == (len(kept), compiler.vocab_size)
    for row, node in enumerate(kept):
        assert torch.equal(masks[row], reference_mask(compiler, grammar, answer + paths[node]))
        parent = pruned.parents[row]
        assert parent == -1 if row == 0 else kept[parent] == parents[node]
    # The matcher is back at the answer's state: the mask at the root again.
    assert torch.equal(constraint.next_mask()[0], masks[0])


def run(engine, prompts, sampling, speculate, grammar, max_tokens=64):
    sequences = [engine.add_request(GenerateRequest(tuple(p), max_tokens, sampling,
                                                    speculate=speculate, grammar=grammar))
                 for p in prompts]
    while engine.has_work():
        engine.step()
    return sequences


@pytest.fixture(scope="module")
def json_prompts(target_model_fp32):
    tokenizer = target_model_fp32.tokenizer
    asks = [f"Here is a record: {RECORD}\nReturn it as JSON with the age increased by one.",
            "Describe a software engineer as JSON with a name, an age and languages."]
    return [conversation_token_ids(tokenizer, [{"role": "user", "content": a}], True)
            for a in asks]


@pytest.mark.parametrize("grammar", [
    Grammar("json_schema", json.dumps(SCHEMA)),
    Grammar("json_object"),
    Grammar("regex", r"[A-Z][a-z]+ \d{1,3}"),
    Grammar("choice", choices=("yes", "no", "it depends")),
], ids=lambda g: g.kind)
def test_constrained_answers_match_and_are_the_same_with_and_without_speculation(
        engine_factory, target_model_fp32, json_prompts, grammar):
    engine, drafter = engine_factory(2)
    tokenizer = target_model_fp32.tokenizer
    try:
        for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=5)):
            plain = run(engine, json_prompts, sampling, False, grammar)
            before = (engine.stats.num_accepted, engine.stats.num_pruned)
            speculated = run(engine, json_prompts, sampling, True, grammar)
            assert [s.output_ids for s in speculated] == [s.output_ids for s in plain]
            for seq in speculated:
                text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
                if seq.finish_reason == "length":
                    continue  # a cut answer is a prefix of a match; complete ones must match
                if grammar.kind == "json_schema":
                    jsonschema.validate(json.loads(text), SCHEMA)
                elif grammar.kind == "json_object":
                    assert isinstance(json.loads(text), dict)
                elif grammar.kind == "choice":
                    assert text in grammar.choices
                else:
                    assert re.fullmatch(grammar.spec, text), text
            if grammar.kind == "json_schema" and sampling.is_greedy:
                assert all(s.finish_reason == "stop" for s in speculated)
                # The copied record is drafted from the prompt and accepted, and the schema
                # drops the draft nodes it forbids.
                assert engine.stats.num_accepted > before[0]
                assert engine.stats.num_pruned > before[1]
    finally:
        drafter.close()


def test_an_engine_without_grammars_refuses_a_constrained_request(engine_factory,
                                                                  mt_bench_prompts):
    engine, _ = engine_factory(1, proposer=None)
    engine.grammars = None
    with pytest.raises(ValueError, match="structured output"):
        engine.add_request(GenerateRequest(tuple(mt_bench_prompts[0]), 4,
                                           grammar=Grammar("json_object")))
    assert not engine.has_work()
