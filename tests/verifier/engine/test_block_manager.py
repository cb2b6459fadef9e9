"""The paged KV cache's block manager: lowest blocks first, reference counts, the prefix cache
keyed by whole prefixes, eviction of cached blocks least recently released first, and requests
that take nothing when the blocks are not there."""

import pytest

from sssd.verifier.engine.block_manager import BlockManager, BlockTable


def tokens(n, start=1):
    return list(range(start, start + n))


def filled(manager, token_ids):
    """A sequence whose context `token_ids` is computed and registered."""
    table = manager.admit(token_ids)
    assert manager.ensure(table, len(token_ids))
    table.num_cached = len(token_ids)
    manager.register_full(table, len(token_ids), lambda p: token_ids[p:])
    return table


def test_blocks_are_handed_out_lowest_first_and_come_back_when_released():
    manager = BlockManager(num_blocks=6, block_size=4, enable_caching=False)
    first, second = BlockTable(), BlockTable()
    assert manager.ensure(first, 9) and first.blocks == [0, 1, 2]
    assert manager.ensure(second, 4) and second.blocks == [3]
    assert manager.ensure(first, 12) and first.blocks == [0, 1, 2]  # already enough
    assert manager.num_free == 2 and manager.usage == pytest.approx(4 / 6)
    manager.release(first)
    assert first.blocks == [] and manager.num_free == 5
    assert manager.ensure(second, 16) and second.blocks == [3, 0, 1, 2]


def test_a_request_the_cache_cannot_meet_takes_nothing():
    manager = BlockManager(num_blocks=3, block_size=4)
    table = BlockTable()
    assert manager.ensure(table, 8)
    assert not manager.can_ensure(table, 13)
    assert not manager.ensure(table, 13)
    assert table.blocks == [0, 1] and manager.num_free == 1


def test_a_prompt_takes_the_longest_cached_prefix_of_whole_blocks():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = filled(manager, tokens(10))  # blocks 0, 1 full (tokens 1-8), block 2 partial
    assert first.blocks == [0, 1, 2] and len(first.hashes) == 2
    same_start = manager.admit(tokens(8) + [99, 100, 101])
    assert same_start.blocks == [0, 1] and same_start.num_cached == 8
    diverges = manager.admit(tokens(4) + [77] * 7)  # the second block differs
    assert diverges.blocks == [0] and diverges.num_cached == 4
    other_start = manager.admit([5, 6, 7, 8] + tokens(4))  # block 1's tokens, first: no hit
    assert other_start.blocks == [] and other_start.num_cached == 0


def test_the_last_token_is_always_computed():
    """A prompt wholly in the cache still computes its last token, whose logits are the next
    token's: its last full block is not taken when the prompt ends with it."""
    manager = BlockManager(num_blocks=16, block_size=4)
    filled(manager, tokens(12))
    again = manager.admit(tokens(12))
    assert again.num_cached == 8 and again.blocks == [0, 1]
    assert manager.admit(tokens(13)).num_cached == 12


def test_shared_blocks_are_counted_and_stay_until_the_last_holder_leaves():
    manager = BlockManager(num_blocks=4, block_size=4)
    first = filled(manager, tokens(8))  # blocks 0, 1
    second = manager.admit(tokens(8) + [50])
    assert second.blocks == [0, 1]
    manager.release(first)
    assert manager.num_free == 2  # blocks 0 and 1 are still held by the second
    manager.release(second)
    assert manager.num_free == 4  # free again, and still cached
    assert manager.admit(tokens(8) + [60]).blocks == [0, 1]


def test_cached_blocks_nobody_holds_are_evicted_least_recently_released_first():
    manager = BlockManager(num_blocks=4, block_size=4)
    old = filled(manager, tokens(4, start=1))  # block 0
    new = filled(manager, tokens(4, start=100))  # block 1
    manager.release(old)
    manager.release(new)
    fresh = BlockTable()
    assert manager.ensure(fresh, 12)  # blocks 2, 3, then the older cached block 0
    assert fresh.blocks == [2, 3, 0]
    assert manager.admit(tokens(4, start=1) + [9]).num_cached == 0  # evicted: its key is gone
    assert manager.admit(tokens(4, start=100) + [9]).num_cached == 4  # block 1 is still there


def test_a_prefix_computed_twice_is_registered_once():
    manager = BlockManager(num_blocks=8, block_size=4)
    first, second = BlockTable(), BlockTable()
    for table in (first, second):  # two sequences computing the same prompt at once
        assert manager.ensure(table, 5)
        table.num_cached = 5
    for table in (first, second):
        manager.register_full(table, 5, lambda p: tokens(5)[p:])
    assert manager.admit(tokens(5) + [9]).blocks == [first.blocks[0]]
    second_blocks = list(second.blocks)
    manager.release(second)
    assert second.blocks == [] and manager.num_free == 8 - 2  # the first holds its two
    fresh = BlockTable()
    assert manager.ensure(fresh, 8) and fresh.blocks == second_blocks  # free, not cached


def test_keys_name_the_whole_prefix_and_the_model():
    """The same tokens after another prefix, or in a cache of another salt (model, dtype), are
    another key."""
    a = BlockManager(num_blocks=8, block_size=4, salt=b"model-a")
    b = BlockManager(num_blocks=8, block_size=4, salt=b"model-b")
    assert a._key(a._salt, [1, 2, 3, 4]) != b._key(b._salt, [1, 2, 3, 4])
    table = filled(a, [9, 9, 9, 9, 1, 2, 3, 4, 5])
    assert a.admit([1, 2, 3, 4, 5]).num_cached == 0  # tokens 1-4 were cached after 9 9 9 9
    assert a.admit([9, 9, 9, 9, 1, 2, 3, 4, 7]).num_cached == 8
    assert len(table.hashes) == 2


def test_prefix_lookups_are_counted_in_tokens():
    manager = BlockManager(num_blocks=8, block_size=4)
    filled(manager, tokens(9))
    table = manager.admit(tokens(8) + [3])
    manager.record_lookup(9, table.num_cached)
    assert (manager.stats.queries, manager.stats.hits) == (9, 8)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)
