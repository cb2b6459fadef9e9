"""Hand-computed cases for the C++ drafter core (and the reference), one rule of
docs/algorithm.md each."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sssd import _core
from sssd.drafter import reference
from sssd.drafter.config import DraftParams


def int32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def float32(values) -> list[float]:
    return np.asarray(values, dtype=np.float32).tolist()


def make_trie(sequence: list[int], branch_len: int = 8) -> _core.InputTrie:
    trie = _core.InputTrie(branch_len)
    trie.append(int32(sequence))
    return trie


def draft(datastore, trie, budget: int, params: reference.DraftParams, core_params):
    """propose_one as plain lists, checked against check_draft_tree."""
    token_ids, parents, probs = _core.BatchDrafter(core_params(params), 1).propose_one(
        datastore, trie, budget)
    assert _core.check_draft_tree(token_ids, parents, probs, budget, int(token_ids[0])) == ""
    return token_ids.tolist(), parents.tolist(), probs.tolist()


# Algorithm 1: input trie --------------------------------------------------------------------------


def test_trie_counts_every_window(core_tree):
    # Windows of 3 over [1, 2, 3, 1, 2, 4]: 123, 231, 312, 124, then the short 24 and 4.
    expected = (-1, 6, (
        (1, 2, ((2, 2, ((3, 1, ()), (4, 1, ()))),)),
        (2, 2, ((3, 1, ((1, 1, ()),)), (4, 1, ()))),
        (3, 1, ((1, 1, ((2, 1, ()),)),)),
        (4, 1, ()),
    ))
    trie = _core.InputTrie(3)
    trie.append(int32([1, 2, 3]))
    trie.append(int32([1, 2, 4]))
    assert trie.check() == ""
    assert core_tree(trie.nodes()) == expected
    assert reference.build_trie([1, 2, 3, 1, 2, 4], 3).root.canonical() == expected

    # Prefix [3, 1, 2, 4]: 3124 is longer than any window; 124, 24 and 4 are found.
    matches = trie.match(4)
    assert [m.match_len for m in matches] == [3, 2, 1]
    assert [core_tree(trie.nodes(), m.node) for m in matches] == [(4, 1, ())] * 3


def test_trie_match_returns_every_suffix_longest_first(core_tree):
    trie = make_trie([1, 2, 3, 1, 2])
    # Prefix [2, 3, 1, 2]: every suffix occurs (as the start of a window); 12 and 2 occur twice,
    # once followed by 3 1 2.
    matches = trie.match(4)
    assert [m.match_len for m in matches] == [4, 3, 2, 1]
    subtrees = [core_tree(trie.nodes(), m.node) for m in matches]
    assert subtrees == [(2, 1, ()), (2, 1, ()), (2, 2, ((3, 1, ((1, 1, ((2, 1, ()),)),)),)),
                        (2, 2, ((3, 1, ((1, 1, ((2, 1, ()),)),)),))]


# Algorithm 3 on the input trie alone --------------------------------------------------------------


def test_merge_reuses_a_token_already_under_the_same_parent(core_params):
    # Sources with children: m=2 (node 12, child discount 0.6 + 0.1 * 2) and m=1 (node 2,
    # 0.6 + 0.1 * 1). Both offer 3 at 0.6: the occurrence of 12 (and of 2) that ends the
    # sequence has no continuation and does not count, so 3 follows them with probability 1.
    # The second 3 (and the 1 and 2 below it) land on the nodes the first created, which keep
    # the m=2 probabilities.
    params = reference.DraftParams()
    first = (1 / 1) * 0.6
    second = (1 / 1) * first * (0.6 + 0.1 * 2)
    third = (1 / 1) * second * (0.6 + 0.1 * 2)
    expected = ([2, 3, 1, 2], [-1, 0, 1, 2], float32([1.0, first, second, third]))
    trie = make_trie([1, 2, 3, 1, 2])
    assert draft(None, trie, 10, params, core_params) == expected
    assert reference.propose([1, 2, 3, 1, 2], [], 10, params) == expected
    truncated = tuple(column[:3] for column in expected)
    assert draft(None, trie, 3, params, core_params) == truncated


def test_budget_one_is_the_root_alone(core_shard, core_params):
    params = reference.DraftParams()
    sequence = [1, 2, 3, 1, 2]
    datastore = _core.Datastore([core_shard([[1, 2, 3, 4]], 5)], 5, params.max_continuations)
    expected = ([2], [-1], [1.0])
    assert draft(datastore, make_trie(sequence), 1, params, core_params) == expected
    shard = reference.build_stream([[1, 2, 3, 4]])
    assert reference.propose(sequence, [(shard, reference.suffix_array(shard))], 1,
                             params) == expected


# Copy source (not in the paper) -------------------------------------------------------------------


def test_copy_chain_goes_on_below_the_input_sources(core_params):
    # Sequence 10..17 99 10 11 12. Copy key: m = 4 (99 10 11 12) occurred nowhere before, m = 3
    # (10 11 12) ends at 3, so the chain is seq[3:9] = 13 14 15 16 17 99 at 0.9, then x 0.5 per
    # level. The input sources (m = 2 and 1) draft 13 14 (15) at 0.6, 0.48 (0.294) from the
    # windows of 4; the chain's 13, 14, 15 land on their nodes and go on below them.
    params = reference.DraftParams(prefix_len=2, branch_len=4, copy_min_match=3, copy_len=6,
                                   copy_discount=0.9, copy_child_discount=0.5)
    sequence = [10, 11, 12, 13, 14, 15, 16, 17, 99, 10, 11, 12]
    assert reference.copy_match(sequence, 3, 4) == (3, 3)
    found = make_trie(sequence, 4).copy_match(3)
    assert (found.end, found.match_len) == (3, 3)
    copy_14 = 1.0 * 0.9 * 0.5
    copy_15 = 1.0 * copy_14 * 0.5
    copy_16 = 1.0 * copy_15 * 0.5
    copy_17 = 1.0 * copy_16 * 0.5
    copy_99 = 1.0 * copy_17 * 0.5
    m2_14 = 1.0 * 0.6 * (0.6 + 0.1 * 2)
    m1_15 = 1.0 * (1.0 * 0.6 * (0.6 + 0.1 * 1)) * (0.6 + 0.1 * 1)
    expected = ([12, 13, 14, 15, 16, 17, 99], [-1, 0, 1, 2, 3, 4, 5],
                float32([1.0, 0.9, m2_14, m1_15, copy_16, copy_17, copy_99]))
    trie = make_trie(sequence, 4)
    assert draft(None, trie, 10, params, core_params) == expected
    assert reference.propose(sequence, [], 10, params) == expected
    # Off, or a key longer than the trie's n-grams: the paper's tree, 3 deep.
    for off in (dataclasses.replace(params, copy_min_match=0),
                dataclasses.replace(params, copy_min_match=5)):
        paper = ([12, 13, 14, 15], [-1, 0, 1, 2], float32([1.0, 0.6, m2_14, m1_15]))
        assert draft(None, trie, 10, off, core_params) == paper
        assert reference.propose(sequence, [], 10, off) == paper


def test_a_long_copy_is_drafted_past_the_trie_windows(core_params):
    # A 40-token span copied again: after its first 10 tokens, the chain holds the other 30 (and
    # then what followed the span), where the input sources end 15 deep (the window of 16 that
    # starts at the key of one token).
    span = list(range(100, 140))
    sequence = span + [7] + span[:10]
    params = reference.DraftParams()
    assert params.copy_min_match > 0 and params.copy_len >= 30
    trie = make_trie(sequence, params.branch_len)

    def depth_followed(draft_params):
        token_ids, parents, _ = draft(None, trie, 64, draft_params, core_params)
        node, depth = 0, 0
        for token in span[10:]:
            node = next((c for c in range(len(token_ids))
                         if parents[c] == node and token_ids[c] == token), None)
            if node is None:
                break
            depth += 1
        return depth

    assert depth_followed(params) == 30
    assert depth_followed(dataclasses.replace(params, copy_min_match=0)) == params.branch_len - 1


# Algorithm 2: datastore ---------------------------------------------------------------------------


def test_continuations_stop_at_the_document_boundary(core_shard, core_params, core_tree):
    # Stream 1 2 3 | 1 2 4 5 |. L=2 finds 12 twice, L=1 finds 2 twice; each time the continuations
    # are [3] (cut at the separator, never "3 | 1 2") and [4, 5].
    documents = [[1, 2, 3], [1, 2, 4, 5]]
    params = reference.DraftParams(prefix_len=2, branch_len=4, max_continuations=10)
    datastore = _core.Datastore([core_shard(documents, 6)], 6, params.max_continuations)
    expected = (2, 4, ((3, 2, ()), (4, 2, ((5, 2, ()),))))
    nodes = datastore.collect(int32([0, 1, 2]), core_params(params))
    assert core_tree(nodes) == expected
    stream = reference.build_stream(documents)
    shards = [(stream, reference.suffix_array(stream))]
    assert reference.collect([0, 1, 2], shards, params).canonical() == expected


def test_a_match_at_the_end_of_a_document_adds_an_empty_continuation(core_shard, core_params,
                                                                     core_tree):
    params = reference.DraftParams(prefix_len=2, branch_len=4)
    datastore = _core.Datastore([core_shard([[1, 2]], 3)], 3, params.max_continuations)
    nodes = datastore.collect(int32([1, 2]), core_params(params))
    assert core_tree(nodes) == (2, 2, ())  # L=2 and L=1 each count the root once
    # A datastore tree without children is no merge source: the draft is the root alone.
    assert draft(datastore, make_trie([1, 2]), 5, params, core_params) == ([2], [-1], [1.0])


def test_samples_spread_evenly_over_the_match_range(core_shard, core_params, core_tree):
    # Six suffixes start with 5 (rows 5-10, after one suffix for each of 0-4), sorted by the next
    # token 0 1 2 3 4 6; quota 3 takes rows k * 6 // 3 = 0, 2, 4 of the block.
    documents = [[5, 0], [5, 1], [5, 2], [5, 3], [5, 4], [5, 6]]
    params = reference.DraftParams(prefix_len=1, branch_len=2, max_continuations=3)
    datastore = _core.Datastore([core_shard(documents, 7)], 7, params.max_continuations)
    assert datastore.find(0, int32([5])) == (5, 11)
    nodes = datastore.collect(int32([5]), core_params(params))
    assert core_tree(nodes) == (5, 3, ((0, 1, ()), (2, 1, ()), (4, 1, ())))


def test_a_range_between_one_and_two_quotas_is_sampled_to_its_end(core_shard, core_params,
                                                                  core_tree):
    # Five suffixes start with 5, next tokens 0 1 2 3 6; quota 3 takes rows k * 5 // 3 = 0, 1, 3.
    # A stride of 5 // 3 = 1 would take 0, 1, 2 and never see the end of the range.
    documents = [[5, 0], [5, 1], [5, 2], [5, 3], [5, 6]]
    params = reference.DraftParams(prefix_len=1, branch_len=2, max_continuations=3)
    datastore = _core.Datastore([core_shard(documents, 7)], 7, params.max_continuations)
    expected = (5, 3, ((0, 1, ()), (1, 1, ()), (3, 1, ())))
    assert core_tree(datastore.collect(int32([5]), core_params(params))) == expected
    stream = reference.build_stream(documents)
    shards = [(stream, reference.suffix_array(stream))]
    assert reference.collect([5], shards, params).canonical() == expected


def test_min_continuations_stops_shortening_the_prefix(core_shard, core_params, core_tree):
    # L=2 (prefix 12) samples one continuation; with min_continuations 1, L=1 (prefix 2) never
    # runs. With 2 it does, and adds 3 (from 1 2 3) and 4 (from 4 2 4).
    documents = [[1, 2, 3], [4, 2, 4]]
    params = reference.DraftParams(prefix_len=2, branch_len=4, min_continuations=1)
    datastore = _core.Datastore([core_shard(documents, 5)], 5, params.max_continuations)
    assert core_tree(datastore.collect(int32([1, 2]), core_params(params))) == (2, 1, ((3, 1, ()),))
    params = reference.DraftParams(prefix_len=2, branch_len=4, min_continuations=2)
    expected = (2, 3, ((3, 2, ()), (4, 1, ())))
    assert core_tree(datastore.collect(int32([1, 2]), core_params(params))) == expected
    stream = reference.build_stream(documents)
    shards = [(stream, reference.suffix_array(stream))]
    assert reference.collect([1, 2], shards, params).canonical() == expected


@pytest.mark.parametrize(("total", "sizes", "quotas"), [
    (10, [3, 3, 4], [3, 3, 4]),  # exact shares
    (5, [1, 1, 1], [2, 2, 1]),  # equal remainders: lower shard index first
    (4, [1, 2, 3], [1, 1, 2]),  # bases 0 1 2, remainders 4 2 0: shard 0 gets the unit
    (3, [0, 5], [0, 3]),
    (0, [4, 4], [0, 0]),
    (7, [0, 0], [0, 0]),  # N = 0, left open by docs/algorithm.md: no continuations
])
def test_apportion_largest_remainder(total, sizes, quotas):
    assert _core.apportion(total, sizes) == quotas
    assert reference.apportion(total, sizes) == quotas


# Algorithm 3: tie-breaking ------------------------------------------------------------------------


def test_equal_priority_goes_to_the_deeper_node(core_shard, core_params):
    # Datastore tree 9 -> {1 -> 3, 2}: 1 and 2 both at 0.5, 1 pushed first. Popping 1 pushes 3 at
    # 0.5 too, one level deeper, so 3 comes before 2 although 2 was pushed earlier.
    documents = [[9, 1, 3], [9, 2]]
    # The paper's child discount 1.0 makes 3 tie with 2 (the tuned default 0.8 would not).
    params = reference.DraftParams(prefix_len=1, datastore_child_discount=1.0)
    datastore = _core.Datastore([core_shard(documents, 10)], 10, params.max_continuations)
    trie = make_trie([9])  # the input trie matches 9 but has nothing after it
    expected = ([9, 1, 3, 2], [-1, 0, 1, 0], [1.0, 0.5, 0.5, 0.5])
    assert draft(datastore, trie, 10, params, core_params) == expected
    assert draft(datastore, trie, 3, params, core_params) == ([9, 1, 3], [-1, 0, 1],
                                                              [1.0, 0.5, 0.5])
    stream = reference.build_stream(documents)
    shards = [(stream, reference.suffix_array(stream))]
    assert reference.propose([9], shards, 10, params) == expected


def test_equal_first_level_priorities_follow_source_order(core_shard, core_params):
    # Sources in push order: the datastore tree 2 -> 8 (1.0 * 0.6), input m=2 (node 12, whose
    # occurrences with a continuation are followed by 3: 1.0 * 0.6) and input m=1 (node 2,
    # children 3 once and 4 twice: 3 at 1/3 * 0.6, 4 at 2/3 * 0.6). The two 0.6 entries tie on
    # priority and depth, so they come out as pushed: 8, then 3; then 5 (under the m=2 source's
    # 3, at 1.0 * 0.6 * 0.8) before 4 (0.4).
    sequence = [1, 2, 3, 5, 2, 4, 6, 2, 4, 7, 1, 2]
    params = reference.DraftParams(prefix_len=2, datastore_discount=0.6)
    datastore = _core.Datastore([core_shard([[1, 2, 8]], 9)], 9, params.max_continuations)
    five = (1 / 1) * ((1 / 1) * 0.6) * (0.6 + 0.1 * 2)
    four = (2 / 3) * 0.6
    expected = ([2, 8, 3, 5, 4], [-1, 0, 0, 2, 0], float32([1.0, 0.6, 0.6, five, four]))
    assert draft(datastore, make_trie(sequence), 5, params, core_params) == expected
    stream = reference.build_stream([[1, 2, 8]])
    shards = [(stream, reference.suffix_array(stream))]
    assert reference.propose(sequence, shards, 5, params) == expected


# Invariant checkers -------------------------------------------------------------------------------


def check_tree(token_ids, parents, probs, max_nodes=8, root_token=7) -> str:
    return _core.check_draft_tree(int32(token_ids), int32(parents),
                                  np.asarray(probs, dtype=np.float32), max_nodes, root_token)


def test_check_draft_tree_accepts_a_sound_tree():
    assert check_tree([7, 1, 2, 1], [-1, 0, 0, 2], [1.0, 0.5, 0.4, 0.3]) == ""


@pytest.mark.parametrize(("token_ids", "parents", "probs", "problem"), [
    ([7, 1, 2], [-1, 0, 2], [1.0, 0.5, 0.4], "not an earlier node"),  # own index
    ([7, 1, 2], [-1, 0, 5], [1.0, 0.5, 0.4], "not an earlier node"),  # out of range
    ([7, 1, 2], [-1, -1, 0], [1.0, 0.5, 0.4], "not an earlier node"),  # a second root
    ([7, 1, 1], [-1, 0, 0], [1.0, 0.5, 0.4], "siblings with the same token"),
    ([7, 1, 2], [0, 0, 0], [1.0, 0.5, 0.4], "not the root"),
    ([8, 1, 2], [-1, 0, 0], [1.0, 0.5, 0.4], "root token"),
    ([7, 1, 2], [-1, 0, 1], [1.0, 0.5, 0.6], "probability"),  # more likely than its parent
    ([7, 1, 2], [-1, 0, 1], [1.0, 0.5, 0.0], "probability"),
    ([7, 1, 2], [-1, 0], [1.0, 0.5, 0.4], "differ in length"),
    ([], [], [], "no root"),
])
def test_check_draft_tree_finds_the_violation(token_ids, parents, probs, problem):
    assert problem in check_tree(token_ids, parents, probs)


def test_check_draft_tree_counts_the_root_in_max_nodes():
    assert check_tree([7, 1, 2], [-1, 0, 0], [1.0, 0.5, 0.4], max_nodes=3) == ""
    assert "more than 2" in check_tree([7, 1, 2], [-1, 0, 0], [1.0, 0.5, 0.4], max_nodes=2)


def test_check_shard_accepts_a_sound_shard(core_shard):
    datastore = _core.Datastore([core_shard([[1, 2, 1], [0, 2]], 3)], 3, 10)
    assert datastore.check_shard(0) == ""


def test_check_shard_detects_swapped_suffix_array_rows(core_shard):
    stream, sa, buckets = core_shard([[1, 2, 1], [0, 2]], 3)
    sa[[2, 4]] = sa[[4, 2]]
    datastore = _core.Datastore([(stream, sa, buckets)], 3, 10)
    assert "out of order" in datastore.check_shard(0)
    assert datastore.check_shard(0, check_order=False) == ""  # still a permutation


def test_check_shard_detects_a_wrong_bucket_index(core_shard):
    stream, sa, buckets = core_shard([[1, 2, 1], [0, 2]], 3)
    buckets[2] += 1
    datastore = _core.Datastore([(stream, sa, buckets)], 3, 10)
    assert "bucket index" in datastore.check_shard(0, check_order=False)


def test_check_shard_detects_a_missing_final_separator(core_shard):
    stream, sa, buckets = core_shard([[1, 2, 1]], 3)
    datastore = _core.Datastore([(stream[:-1], sa[:-1], buckets)], 3, 10)
    assert "separator" in datastore.check_shard(0)


# Parameters ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"prefix_len": 0},
    {"prefix_len": 5, "branch_len": 4},
    {"branch_len": 65},
    {"max_continuations": -1},
    {"min_continuations": -1},
    {"input_discount": 1.5},
    {"datastore_child_discount": -0.1},
    {"input_child_discount_base": 0.7},  # 0.7 + 0.1 * 4 > 1
    {"copy_min_match": -1},
    {"copy_min_match": 65},
    {"copy_len": 0},
    {"copy_len": 257},
    {"copy_discount": 0.0},
    {"copy_child_discount": 1.5},
])
def test_invalid_params_are_rejected_by_both(fields):
    core = _core.DrafterParams()
    for name, value in fields.items():
        setattr(core, name, value)
    assert core.validate() != ""
    with pytest.raises(ValueError):
        _core.BatchDrafter(core, 1)
    with pytest.raises(ValueError):
        reference.DraftParams(**fields)


def test_separator_agrees():
    assert _core.DOCUMENT_SEPARATOR == reference.DOCUMENT_SEPARATOR == 0xFFFFFFFF


def test_default_params_agree():
    """One definition (the C++ header); the service's configuration and the reference take it
    over, field for field."""
    core = _core.DrafterParams()
    assert core.validate() == ""
    configured, ours = DraftParams(), reference.DraftParams()
    assert [f.name for f in dataclasses.fields(configured)] == \
        [f.name for f in dataclasses.fields(ours)]
    for field in dataclasses.fields(configured):
        assert getattr(core, field.name) == getattr(configured, field.name) \
            == getattr(ours, field.name), field.name
    core_fields = {name for name in dir(core) if not name.startswith("_") and name != "validate"}
    assert core_fields == {f.name for f in dataclasses.fields(configured)}


@pytest.mark.parametrize("field", ["datastore_discount", "input_discount",
                                   "datastore_child_discount", "input_child_discount_base"])
def test_zero_discounts_are_refused_by_both(core_params, field):
    # A zero factor would put zero-probability nodes into the draft tree.
    params = _core.DrafterParams()
    setattr(params, field, 0.0)
    assert "discounts must be in (0, 1]" in params.validate()
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        reference.DraftParams(**{field: 0.0})
    params = _core.DrafterParams()
    params.input_child_discount_per_match = 0.0
    assert params.validate() == ""