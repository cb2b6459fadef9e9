"""Property tests: the C++ drafter core equals the plain-Python reference of docs/algorithm.md.

Vocabularies are tiny (2-12 tokens) so that repeated n-grams, shared continuations and priority
ties, the cases where the two could disagree, happen in most examples.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sssd import _core
from sssd.drafter import reference

PROPERTY = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

vocab_sizes = st.integers(min_value=2, max_value=12)


@st.composite
def documents(draw, vocab_size: int, max_documents: int = 6) -> list[list[int]]:
    """Whole documents of one shard, empty ones included."""
    token = st.integers(min_value=0, max_value=vocab_size - 1)
    return draw(st.lists(st.lists(token, max_size=14), max_size=max_documents))


@st.composite
def sequences(draw, vocab_size: int) -> list[int]:
    """A non-empty accepted sequence; token vocab_size lies outside the datastore's vocabulary."""
    token = st.integers(min_value=0, max_value=vocab_size)
    return draw(st.lists(token, min_size=1, max_size=40))


def discounts(min_value: float = 0.0, max_value: float = 1.0) -> st.SearchStrategy[float]:
    """Mostly round values (ties between sources), sometimes arbitrary doubles (rounding order)."""
    round_values = [v for v in (0.1, 0.25, 0.5, 0.6, 1.0) if min_value <= v <= max_value]
    return st.one_of(st.sampled_from(round_values),
                     st.floats(min_value=min_value, max_value=max_value))


@st.composite
def draft_params(draw) -> reference.DraftParams:
    """Random valid parameters. Discounts stay positive: a zero discount yields zero-probability
    nodes, which check_draft_tree rejects (see test_core_invariants)."""
    prefix_len = draw(st.integers(min_value=1, max_value=4))
    per_match = draw(st.one_of(st.just(0.1), st.floats(min_value=0.0, max_value=0.2)))
    base_limit = 1.0 - per_match * prefix_len
    base = draw(st.one_of(st.sampled_from([base_limit, base_limit / 2]),
                          st.floats(min_value=0.05, max_value=1.0).map(lambda u: u * base_limit)))
    branch_len = draw(st.integers(min_value=prefix_len, max_value=8))
    return reference.DraftParams(
        prefix_len=prefix_len,
        branch_len=branch_len,
        max_continuations=draw(st.integers(min_value=0, max_value=30)),
        min_continuations=draw(st.integers(min_value=0, max_value=60)),
        datastore_discount=draw(discounts(min_value=0.05)),
        input_discount=draw(discounts(min_value=0.05)),
        datastore_child_discount=draw(discounts(min_value=0.05)),
        input_child_discount_base=base,
        input_child_discount_per_match=per_match,
        # 0 (off), every key length the trie holds, and one it cannot (finds nothing)
        copy_min_match=draw(st.integers(min_value=0, max_value=branch_len + 1)),
        copy_len=draw(st.integers(min_value=1, max_value=12)),
        copy_discount=draw(discounts(min_value=0.05)),
        copy_child_discount=draw(discounts(min_value=0.05)),
    )


@st.composite
def datastores(draw) -> tuple[int, list[list[list[int]]]]:
    """(vocab_size, documents of each of 0-3 shards)."""
    vocab_size = draw(vocab_sizes)
    shards = draw(st.lists(documents(vocab_size), max_size=3))
    return vocab_size, shards


def build_both(vocab_size, shard_documents, max_continuations, core_shard, weights=None):
    """The same datastore twice: core Datastore and reference [(stream, sa)]; with `weights`
    the core's shards carry them (docs/algorithm.md, Shard weights)."""
    core_shards = [core_shard(docs, vocab_size) for docs in shard_documents]
    views = core_shards if weights is None else [(*shard, w)
                                                 for shard, w in zip(core_shards, weights)]
    core = _core.Datastore(views, vocab_size, max_continuations)
    ref = [(s.tolist(), sa.tolist()) for s, sa, _ in core_shards]
    return core, ref


def assert_same_draft(core_draft, ref_draft, budget: int, root_token: int) -> None:
    """Equal node for node (probs as float32, bit for bit), and a sound draft tree."""
    token_ids, parents, probs = core_draft
    assert token_ids.tolist() == ref_draft[0]
    assert parents.tolist() == ref_draft[1]
    assert np.asarray(probs, dtype=np.float32).tolist() == ref_draft[2]
    assert _core.check_draft_tree(np.asarray(token_ids, dtype=np.int32),
                                  np.asarray(parents, dtype=np.int32),
                                  np.asarray(probs, dtype=np.float32), budget, root_token) == ""


# (a) Suffix array ---------------------------------------------------------------------------------


@PROPERTY
@given(data=st.data())
def test_suffix_array_equals_naive_sort(data):
    vocab_size = data.draw(vocab_sizes)
    stream = reference.build_stream(data.draw(documents(vocab_size, max_documents=10)))
    core = _core.build_suffix_array(np.asarray(stream, dtype=np.uint32), vocab_size)
    assert core.dtype == np.uint32
    assert core.tolist() == reference.suffix_array(stream)


# (b) Input trie -----------------------------------------------------------------------------------


@st.composite
def chunked(draw, sequence: list[int]) -> list[list[int]]:
    """`sequence` split at random cut points (empty chunks included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(sequence)), max_size=6)))
    bounds = [0, *cuts, len(sequence)]
    return [sequence[a:b] for a, b in zip(bounds, bounds[1:])]


@PROPERTY
@given(data=st.data())
def test_incremental_trie_equals_reference(data, core_tree):
    vocab_size = data.draw(vocab_sizes)
    sequence = data.draw(sequences(vocab_size))
    branch_len = data.draw(st.integers(min_value=1, max_value=8))
    prefix_len = data.draw(st.integers(min_value=1, max_value=min(4, branch_len)))

    copy_min_len = data.draw(st.integers(min_value=1, max_value=branch_len + 1))

    trie = _core.InputTrie(branch_len)
    incremental = reference.InputTrie(branch_len)
    for chunk in data.draw(chunked(sequence)):
        trie.append(np.asarray(chunk, dtype=np.int32))
        incremental.append(chunk)
        assert trie.check() == ""
        # The copy source's match follows the appends: each n-gram's latest two ends.
        found = trie.copy_match(copy_min_len)
        expected = reference.copy_match(incremental.tokens, copy_min_len, branch_len)
        assert (found.end, found.match_len) == (expected or (-1, 0))
    rebuilt = reference.build_trie(sequence, branch_len)

    assert trie.tokens().tolist() == sequence
    assert trie.num_tokens == len(sequence)
    nodes = trie.nodes()
    assert core_tree(nodes) == rebuilt.root.canonical()
    assert incremental.root.canonical() == rebuilt.root.canonical()

    core_matches = trie.match(prefix_len)
    ref_matches = rebuilt.match(prefix_len)
    assert [m.match_len for m in core_matches] == [m for _, m in ref_matches]
    for core_match, (ref_node, _) in zip(core_matches, ref_matches):
        assert core_tree(nodes, core_match.node) == ref_node.canonical()


# (c) Range lookup and quotas ---------------------------------------------------------------------


@PROPERTY
@given(data=st.data())
def test_find_equals_reference(data, core_shard):
    vocab_size, shard_documents = data.draw(datastores())
    max_continuations = data.draw(st.integers(min_value=0, max_value=30))
    core, ref = build_both(vocab_size, shard_documents, max_continuations, core_shard)

    assert core.num_shards == len(ref)
    assert core.num_tokens == sum(len(stream) for stream, _ in ref)
    assert core.quotas == reference.apportion(max_continuations, [len(s) for s, _ in ref])
    assert sum(core.quotas) == (max_continuations if core.num_tokens else 0)
    query_token = st.integers(min_value=0, max_value=vocab_size)
    for shard, (stream, sa) in enumerate(ref):
        assert core.check_shard(shard) == ""
        buckets = reference.bucket_starts(stream, vocab_size)
        for token in range(vocab_size):
            assert reference.find_range(stream, sa, [token]) == (buckets[token], buckets[token + 1])
        for query in data.draw(st.lists(st.lists(query_token, max_size=5), max_size=8)):
            found = tuple(core.find(shard, np.asarray(query, dtype=np.int32)))
            expected = reference.find_range(stream, sa, query)
            if any(token >= vocab_size for token in query):
                # A token outside the vocabulary matches nothing: the core answers (0, 0), the
                # bisect its insertion point; only emptiness matters to Algorithm 2.
                assert found[0] == found[1] and expected[0] == expected[1], query
            else:
                assert found == expected, query


@PROPERTY
@given(total=st.integers(min_value=0, max_value=200),
       sizes=st.lists(st.integers(min_value=0, max_value=50), max_size=6))
def test_apportion_equals_reference(total, sizes):
    assert _core.apportion(total, sizes) == reference.apportion(total, sizes)


# (d) Datastore tree ------------------------------------------------------------------------------


@PROPERTY
@given(data=st.data())
def test_collect_equals_reference(data, core_shard, core_params, core_tree):
    vocab_size, shard_documents = data.draw(datastores())
    params = data.draw(draft_params())
    sequence = data.draw(sequences(vocab_size))
    core, ref = build_both(vocab_size, shard_documents, params.max_continuations, core_shard)

    nodes = core.collect(np.asarray(sequence, dtype=np.int32), core_params(params))
    assert core_tree(nodes) == reference.collect(sequence, ref, params).canonical()


@PROPERTY
@given(data=st.data())
def test_weighted_collect_equals_reference(data, core_shard, core_params, core_tree):
    vocab_size, shard_documents = data.draw(datastores())
    weights = data.draw(st.lists(st.integers(min_value=1, max_value=7),
                                 min_size=len(shard_documents), max_size=len(shard_documents)))
    params = data.draw(draft_params())
    sequence = data.draw(sequences(vocab_size))
    core, ref = build_both(vocab_size, shard_documents, params.max_continuations, core_shard,
                           weights)

    weighted_sizes = [len(stream) * w for (stream, _), w in zip(ref, weights)]
    assert core.quotas == reference.apportion(params.max_continuations, weighted_sizes)
    nodes = core.collect(np.asarray(sequence, dtype=np.int32), core_params(params))
    assert core_tree(nodes) == reference.collect(sequence, ref, params, weights).canonical()
    trie = _core.InputTrie(params.branch_len)
    trie.append(np.asarray(sequence, dtype=np.int32))
    drafter = _core.BatchDrafter(core_params(params), 1)
    assert_same_draft(drafter.propose_one(core, trie, 12),
                      reference.propose(sequence, ref, 12, params, weights), 12, sequence[-1])


def test_shard_weight_out_of_range_is_refused(core_shard):
    shard = core_shard([[1, 2, 3]], 8)
    for weight in (0, -1, 1001):
        with pytest.raises(ValueError, match="shard weight must be in"):
            _core.Datastore([(*shard, weight)], 8, 10)
    with pytest.raises(ValueError, match="one weight in"):
        reference.collect([1], [(shard[0].tolist(), shard[1].tolist())],
                          reference.DraftParams(), [0])


# (e) Draft trees ---------------------------------------------------------------------------------


@PROPERTY
@given(data=st.data())
def test_propose_one_equals_reference(data, core_shard, core_params):
    vocab_size, shard_documents = data.draw(datastores())
    params = data.draw(draft_params())
    sequence = data.draw(sequences(vocab_size))
    budget = data.draw(st.integers(min_value=1, max_value=40))
    core, ref = build_both(vocab_size, shard_documents, params.max_continuations, core_shard)
    if not shard_documents and data.draw(st.booleans()):
        core = None  # no datastore at all behaves like an empty one

    trie = _core.InputTrie(params.branch_len)
    trie.append(np.asarray(sequence, dtype=np.int32))
    drafter = _core.BatchDrafter(core_params(params), 1)
    assert_same_draft(drafter.propose_one(core, trie, budget),
                      reference.propose(sequence, ref, budget, params), budget, sequence[-1])


@st.composite
def batch_rows(draw, vocab_size: int) -> list[tuple[list[int], list[list[int]], list[int]]]:
    """Rows of (tokens appended before drafting, new tokens of each of two calls, budgets)."""
    rows = []
    for _ in range(draw(st.integers(min_value=1, max_value=5))):
        sequence = draw(sequences(vocab_size))
        first, second = sorted(draw(st.lists(st.integers(0, len(sequence)), min_size=2,
                                             max_size=2)))
        # Each call must leave the row with at least one token.
        first = max(first, 1) if second == 0 else first
        second = max(second, 1)
        budgets = draw(st.lists(st.integers(min_value=1, max_value=40), min_size=2, max_size=2))
        rows.append((sequence[:first], [sequence[first:second], sequence[second:]], budgets))
    return rows


@PROPERTY
@given(data=st.data())
def test_batched_propose_equals_reference(data, core_shard, core_params):
    vocab_size, shard_documents = data.draw(datastores())
    params = data.draw(draft_params())
    rows = data.draw(batch_rows(vocab_size))
    core, ref = build_both(vocab_size, shard_documents, params.max_continuations, core_shard)

    for num_threads in (1, 2):
        drafter = _core.BatchDrafter(core_params(params), num_threads)
        assert drafter.num_threads == num_threads
        tries = [_core.InputTrie(params.branch_len) for _ in rows]
        sequences_so_far = [list(initial) for initial, _, _ in rows]
        for trie, initial in zip(tries, sequences_so_far):
            trie.append(np.asarray(initial, dtype=np.int32))
        for call in range(2):
            new = [chunks[call] for _, chunks, _ in rows]
            budgets = [b[call] for _, _, b in rows]
            cu_num_new_tokens = np.cumsum([0, *map(len, new)], dtype=np.int64)
            new_tokens = np.asarray([t for chunk in new for t in chunk], dtype=np.int32)
            token_ids, parents, probs, cu_num_nodes = drafter.propose(
                core, tries, new_tokens, cu_num_new_tokens, np.asarray(budgets, dtype=np.int32))
            assert cu_num_nodes[0] == 0 and cu_num_nodes[-1] == len(token_ids)
            for row, (chunk, budget) in enumerate(zip(new, budgets)):
                sequence = sequences_so_far[row]
                sequence.extend(chunk)
                assert tries[row].tokens().tolist() == sequence
                rows_nodes = slice(cu_num_nodes[row], cu_num_nodes[row + 1])
                core_draft = (token_ids[rows_nodes], parents[rows_nodes], probs[rows_nodes])
                assert_same_draft(core_draft, reference.propose(sequence, ref, budget, params),
                                  budget, sequence[-1])
