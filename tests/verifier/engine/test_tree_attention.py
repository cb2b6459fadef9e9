"""The KV cache and the tree batch against a plain reference: per row and per node, attention
over an explicitly listed set of cached prefix positions, ancestors and the node itself.

No model: random keys, values and queries through the same path the model takes (the tree
batch's mask and positions, `SlotKVCache.update` inside the forward pass, `commit` after it).
"""

import math

import numpy as np
import pytest
import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.model.kv_cache import SlotKVCache
from sssd.common.model.tree_batch import build_tree_batch

HEADS, HEAD_DIM, MAX_LEN = 2, 8, 64


def random_tree(rng: np.random.Generator, num_nodes: int) -> DraftTree:
    """Parents before children; any node may branch."""
    parents = [-1] + [int(rng.integers(0, node)) for node in range(1, num_nodes)]
    return DraftTree(rng.integers(0, 100, size=num_nodes).astype(np.int32),
                     np.array(parents, dtype=np.int32))


def ancestors_and_self(parents: np.ndarray, node: int) -> list[int]:
    chain = []
    while node != -1:
        chain.append(node)
        node = int(parents[node])
    return chain


def naive_attention(query, keys, values):
    """query [heads, head_dim]; keys, values [heads, n, head_dim] -> [heads, head_dim]."""
    scores = torch.einsum("hd,hnd->hn", query, keys) / math.sqrt(HEAD_DIM)
    return torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), values)


def make_step(seed: int, num_rows: int):
    rng = np.random.default_rng(seed)
    cache = SlotKVCache(num_layers=1, max_seqs=num_rows, num_kv_heads=HEADS, max_len=MAX_LEN,
                        head_dim=HEAD_DIM, dtype=torch.float64)
    cache_lens = [int(rng.integers(0, 20)) for _ in range(num_rows)]
    prefixes = []
    for row, length in enumerate(cache_lens):
        keys = torch.randn(HEADS, length, HEAD_DIM, dtype=torch.float64)
        values = torch.randn(HEADS, length, HEAD_DIM, dtype=torch.float64)
        cache.keys[0][row, :, :length] = keys
        cache.values[0][row, :, :length] = values
        cache.set_length(row, length)
        prefixes.append((keys, values))
    trees = [random_tree(rng, int(rng.integers(1, 12))) for _ in range(num_rows)]
    return cache, cache_lens, prefixes, trees


@pytest.mark.parametrize("seed", range(12))
def test_tree_attention_equals_explicit_per_node_attention(seed):
    torch.manual_seed(seed)
    num_rows = 1 + seed % 4
    cache, cache_lens, prefixes, trees = make_step(seed, num_rows)
    batch = build_tree_batch(trees, cache_lens, torch.float64)
    max_nodes = batch.input_ids.shape[1]
    # [num_rows, heads, max_nodes, head_dim]: what the model's projections would produce.
    node_keys = torch.randn(num_rows, HEADS, max_nodes, HEAD_DIM, dtype=torch.float64)
    node_values = torch.randn(num_rows, HEADS, max_nodes, HEAD_DIM, dtype=torch.float64)
    queries = torch.randn(num_rows, HEADS, max_nodes, HEAD_DIM, dtype=torch.float64)

    cache.begin_step(0, num_rows, batch.write_positions, batch.kv_len)
    keys, values = cache.update(node_keys, node_values, layer_idx=0)
    scores = queries @ keys.transpose(-1, -2) / math.sqrt(HEAD_DIM) + batch.attention_mask
    attended = torch.softmax(scores, dim=-1) @ values  # [num_rows, heads, max_nodes, head_dim]

    for row, (tree, length) in enumerate(zip(trees, cache_lens)):
        prefix_keys, prefix_values = prefixes[row]
        depths = []
        for node in range(tree.num_nodes):
            visible = sorted(ancestors_and_self(tree.parents, node))
            depths.append(len(visible) - 1)
            expected = naive_attention(
                queries[row, :, node],
                torch.cat([prefix_keys, node_keys[row, :, visible]], dim=1),
                torch.cat([prefix_values, node_values[row, :, visible]], dim=1))
            torch.testing.assert_close(attended[row, :, node], expected)
        assert batch.position_ids[row, : tree.num_nodes].tolist() == \
            [length + depth for depth in depths]
        assert batch.input_ids[row, : tree.num_nodes].tolist() == tree.token_ids.tolist()
        assert batch.num_nodes[row] == tree.num_nodes


@pytest.mark.parametrize("seed", range(8))
def test_commit_keeps_the_root_and_the_accepted_path_in_order(seed):
    rng = np.random.default_rng(100 + seed)
    num_rows = 3
    cache, cache_lens, prefixes, trees = make_step(100 + seed, num_rows)
    batch = build_tree_batch(trees, cache_lens, torch.float64)
    max_nodes = batch.input_ids.shape[1]
    node_keys = torch.randn(num_rows, HEADS, max_nodes, HEAD_DIM, dtype=torch.float64)
    node_values = torch.randn(num_rows, HEADS, max_nodes, HEAD_DIM, dtype=torch.float64)
    cache.begin_step(0, num_rows, batch.write_positions, batch.kv_len)
    cache.update(node_keys, node_values, layer_idx=0)
    paths = []
    for tree in trees:  # a random root-to-node path, root excluded, in path order
        end = int(rng.integers(0, tree.num_nodes))
        paths.append(list(reversed(ancestors_and_self(tree.parents, end)))[1:])
    cache.commit(range(num_rows), paths)
    for row, (path, length) in enumerate(zip(paths, cache_lens)):
        assert cache.lengths[row] == length + 1 + len(path)
        kept = [0] + path  # node indices now at length, length + 1, ...
        torch.testing.assert_close(cache.keys[0][row, :, length: length + len(kept)],
                                   node_keys[row, :, kept], rtol=0, atol=0)
        torch.testing.assert_close(cache.values[0][row, :, length: length + len(kept)],
                                   node_values[row, :, kept], rtol=0, atol=0)
        # The prefix is untouched.
        torch.testing.assert_close(cache.keys[0][row, :, :length], prefixes[row][0],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_commit_in_one_kernel_call_equals_the_indexed_copies(seed, dtype):
    """On the CPU `commit` moves every layer's positions in one sssd._kernels call; it must
    leave every buffer as the indexed copies do (which gather all sources first), here over
    three layers and four slots, with paths that skip nodes so that moves chain."""
    rng = np.random.default_rng(300 + seed)
    caches = [SlotKVCache(num_layers=3, max_seqs=4, num_kv_heads=HEADS, max_len=MAX_LEN,
                          head_dim=HEAD_DIM, dtype=dtype) for _ in range(2)]
    assert caches[0].layout is not None
    caches[1].layout = None  # the indexed copies
    generator = torch.Generator().manual_seed(seed)
    for buffer_index in range(6):
        filled = torch.randn(caches[0].keys[0].shape, generator=generator).to(dtype)
        for cache in caches:
            (*cache.keys, *cache.values)[buffer_index].copy_(filled)
    lengths = [int(rng.integers(0, 30)) for _ in range(4)]
    paths = []
    for length in lengths:
        nodes = sorted(rng.choice(np.arange(1, 20), size=int(rng.integers(0, 8)),
                                  replace=False).tolist())
        paths.append(nodes)  # increasing node indices, as along a tree's path
    for cache in caches:
        for slot, length in enumerate(lengths):
            cache.set_length(slot, length)
        cache.commit(range(4), paths)
    assert caches[0].lengths == caches[1].lengths
    assert any(node != depth for path in paths for depth, node in enumerate(path, start=1))
    for ours, theirs in zip((*caches[0].keys, *caches[0].values),
                            (*caches[1].keys, *caches[1].values)):
        assert torch.equal(ours, theirs)


def test_move_positions_refuses_mismatched_or_outside_moves():
    from sssd import _kernels

    cache = SlotKVCache(num_layers=1, max_seqs=2, num_kv_heads=HEADS, max_len=MAX_LEN,
                        head_dim=HEAD_DIM, dtype=torch.float32)
    with pytest.raises(ValueError, match="one target per source"):
        _kernels.move_positions(cache.layout, [0, 0], [3])
    before = [buffer.clone() for buffer in (*cache.keys, *cache.values)]
    end = 2 * cache.capacity  # past the cache's last position
    for sources, targets in (([end], [1]), ([5], [end + 3]), ([5], [-1])):
        with pytest.raises(IndexError, match="outside the cache"):
            _kernels.move_positions(cache.layout, sources, targets)
    # a tree node past the cache's end, as commit would hand it over
    cache.set_length(0, cache.capacity - 2)
    with pytest.raises(IndexError, match="outside the cache"):
        cache.commit([0], [[5]])
    assert cache.lengths[0] == cache.capacity - 2  # the refused commit kept the length
    for buffer, kept in zip((*cache.keys, *cache.values), before):
        assert torch.equal(buffer, kept)


def test_move_copies_a_slot_and_frees_the_source():
    cache, cache_lens, prefixes, _ = make_step(7, 3)
    cache.move(2, 0)
    assert cache.lengths[0] == cache_lens[2] and cache.lengths[2] == 0
    torch.testing.assert_close(cache.keys[0][0, :, : cache_lens[2]], prefixes[2][0],
                               rtol=0, atol=0)
    torch.testing.assert_close(cache.values[0][0, :, : cache_lens[2]], prefixes[2][1],
                               rtol=0, atol=0)
