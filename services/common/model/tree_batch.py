"""Everything the forward pass derives from draft trees: inputs, tree positions, visibility.

The one place where `parents` becomes a mask. Row i of a step holds the draft
tree of one sequence whose first `cache_lens[i]` tokens are already in the KV cache; the tree's
node j goes to cache position `cache_lens[i] + j` and has position id `cache_lens[i] + depth(j)`,
and attends to the cached prefix, its ancestors and itself (SpecInfer-style tree attention).

Visibility comes in two forms: `tree_bits`, one 64-bit mask per node (what the verifier's own
attention kernel reads, for trees of up to 64 nodes), and `attention_mask`, the additive
[num_seqs, 1, num_nodes, kv_len] tensor of the transformers forward and of long prompts, built
only when a forward pass asks for it.

Everything is built on the host from the trees (numpy, no per-node tensor operations) and goes
to the step's device in one copy per tensor, queued without waiting (`non_blocking`): a GPU step
never waits on the host for its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.model.kv_cache import KV_ALIGN

MAX_TREE_BITS_NODES = 64  # nodes per row that `tree_bits` can describe


@dataclass(frozen=True)
class TreeBatch:
    input_ids: torch.Tensor  # [num_seqs, max_nodes] int64, padded with the root token
    position_ids: torch.Tensor  # [num_seqs, max_nodes] int64
    write_positions: torch.Tensor  # [num_seqs, max_nodes] int64: cache slot of each node
    cache_lens: torch.Tensor  # [num_seqs] int64: tokens already cached per row
    host_cache_lens: tuple[int, ...]  # the same on the host: building the mask reads no device
    # [num_seqs, max_nodes] int64 bit masks: bit a of node j set when j sees node a (itself, its
    # ancestors; a padding node only itself); None above MAX_TREE_BITS_NODES nodes
    tree_bits: torch.Tensor | None
    num_nodes: list[int]  # [num_seqs] real (unpadded) nodes per row
    kv_len: int  # cache positions the step attends over: max(cache_lens) + max_nodes, aligned
    trees: Sequence[DraftTree]
    dtype: torch.dtype  # of the additive mask
    # [num_seqs, max_blocks] int32 on the host: each row's cache blocks in position order,
    # covering kv_len positions (padded with block 0, which no row reads past its length);
    # None for a slot cache, whose rows are its slots
    block_tables: torch.Tensor | None = None

    @cached_property
    def attention_mask(self) -> torch.Tensor:
        """[num_seqs, 1, max_nodes, kv_len] additive (0: attend; the dtype's lowest value: not),
        built on first use."""
        num_seqs, max_nodes = self.input_ids.shape
        allowed = np.zeros((num_seqs, max_nodes, self.kv_len), dtype=bool)
        for row, (tree, cache_len) in enumerate(zip(self.trees, self.host_cache_lens)):
            n = tree.num_nodes
            allowed[row, :, :cache_len] = True
            allowed[row, :n, cache_len : cache_len + n] = ancestor_matrix(tree.parents)
            # A padding query sees only itself, which keeps its softmax finite.
            padding = np.arange(n, max_nodes)
            allowed[row, padding, cache_len + padding] = True
        mask = torch.zeros((num_seqs, 1, max_nodes, self.kv_len), dtype=self.dtype)
        mask.masked_fill_(torch.from_numpy(~allowed).unsqueeze(1), torch.finfo(self.dtype).min)
        return mask.to(self.input_ids.device, non_blocking=True)

    def path_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each node's keys in the order of their text positions: the cached prefix, then its
        ancestors from the root, then itself (a padding node: the prefix and itself), as cache
        positions [num_seqs, max_nodes, kv_len] int64 (past the node's own, the position
        itself, masked), and the additive mask [num_seqs * max_nodes, 1, 1, kv_len] that hides
        them.

        A node attends over the same sequence of keys as plain decoding of its text does, at
        the same offsets: the sums of an attention kernel that reduces keys in blocks group
        them the same way, whatever the tree (see decoder.path_attention)."""
        num_seqs, max_nodes = self.input_ids.shape
        kv_len = self.kv_len
        positions = np.broadcast_to(np.arange(kv_len, dtype=np.int64),
                                    (num_seqs, max_nodes, kv_len)).copy()
        seen = np.empty((num_seqs, max_nodes), dtype=np.int64)  # keys each node sees
        for row, (tree, cache_len) in enumerate(zip(self.trees, self.host_cache_lens)):
            paths = root_paths(tree.parents)
            for node in range(max_nodes):
                path = paths[node] if node < tree.num_nodes else [node]
                positions[row, node, cache_len:cache_len + len(path)] = \
                    cache_len + np.asarray(path)
                seen[row, node] = cache_len + len(path)
        hidden = np.arange(kv_len)[None, None, :] >= seen[:, :, None]
        mask = torch.zeros((num_seqs * max_nodes, 1, 1, kv_len), dtype=self.dtype)
        mask.masked_fill_(torch.from_numpy(hidden.reshape(-1, 1, 1, kv_len)),
                          torch.finfo(self.dtype).min)
        device = self.input_ids.device
        return (torch.from_numpy(positions).to(device, non_blocking=True),
                mask.to(device, non_blocking=True))


def root_paths(parents: np.ndarray) -> list[list[int]]:
    """Per node, the nodes from the root down to it (itself last)."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    return paths


def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """[num_nodes, num_nodes] bool: entry (j, a) is True when a is j or an ancestor of j."""
    num_nodes = parents.shape[0]
    visible = np.zeros((num_nodes, num_nodes), dtype=bool)
    for node in range(num_nodes):
        parent = parents[node]
        if parent >= 0:
            visible[node] = visible[parent]  # parents come before children
        visible[node, node] = True
    return visible


def depths_and_bits(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per node: its depth, and the bit mask of itself and its ancestors (Python ints, any
    number of nodes)."""
    depths, bits = [0] * len(parents), [1] * len(parents)
    for node in range(1, len(parents)):
        parent = parents[node]
        depths[node] = depths[parent] + 1
        bits[node] = bits[parent] | (1 << node)
    return depths, bits


def build_tree_batch(
    trees: Sequence[DraftTree], cache_lens: Sequence[int], dtype: torch.dtype,
    kv_align: int = KV_ALIGN, device: torch.device | str = "cpu", min_nodes: int = 1,
    block_tables: Sequence[Sequence[int]] | None = None, block_size: int = 16,
) -> TreeBatch:
    """`kv_align`: the key length of the step is rounded up to a multiple of it (see KV_ALIGN).
    `dtype`: of the additive mask, when one is asked for. `device`: where the tensors go.
    `min_nodes`: the fewest nodes per row (padding nodes, as for a row of a smaller tree).
    `block_tables`: each row's blocks of a paged cache of `block_size` positions a block; they
    must hold the row's cached positions and every node the step writes."""
    num_seqs = len(trees)
    max_nodes = max(min_nodes, *(tree.num_nodes for tree in trees))
    kv_len = -(-(max(cache_lens) + max_nodes) // kv_align) * kv_align
    lens = np.asarray(cache_lens, dtype=np.int64)  # [num_seqs]
    input_ids = np.empty((num_seqs, max_nodes), dtype=np.int64)
    depths = np.zeros((num_seqs, max_nodes), dtype=np.int64)  # padding nodes at depth 0
    with_bits = max_nodes <= MAX_TREE_BITS_NODES
    if with_bits:
        # Padding nodes (j >= num_nodes) see only themselves, which keeps their softmax finite;
        # they are written past the real ones and never committed.
        own = np.left_shift(np.uint64(1), np.arange(max_nodes, dtype=np.uint64))
        bits = np.tile(own, (num_seqs, 1))  # [num_seqs, max_nodes] uint64
    for row, tree in enumerate(trees):
        n = tree.num_nodes
        input_ids[row, :n] = tree.token_ids
        input_ids[row, n:] = tree.token_ids[0]
        if n > 1 and is_chain(tree.parents):  # a prompt
            depths[row, :n] = np.arange(n)
            if with_bits:  # nodes 0..j (2^(j + 1) - 1; at j = 63 the shift wraps to 0)
                bits[row, :n] = (own[:n] << np.uint64(1)) - np.uint64(1)
        elif n > 1:
            row_depths, row_bits = depths_and_bits(tree.parents.tolist())
            depths[row, :n] = row_depths
            if with_bits:
                bits[row, :n] = row_bits

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    tables = None
    if block_tables is not None:
        width = max(-(-kv_len // block_size), *(len(t) for t in block_tables))
        padded = np.zeros((num_seqs, width), dtype=np.int32)
        for row, (table, cache_len) in enumerate(zip(block_tables, cache_lens)):
            if len(table) * block_size < cache_len + max_nodes:
                raise ValueError(f"row {row}'s {len(table)} blocks hold {len(table) * block_size}"
                                 f" positions, the step writes up to {cache_len + max_nodes}")
            padded[row, :len(table)] = table
        tables = torch.from_numpy(padded)
    return TreeBatch(
        input_ids=on_device(input_ids),
        position_ids=on_device(lens[:, None] + depths),
        write_positions=on_device(lens[:, None] + np.arange(max_nodes)),
        cache_lens=on_device(lens),
        host_cache_lens=tuple(int(n) for n in cache_lens),
        tree_bits=on_device(bits.view(np.int64)) if with_bits else None,
        num_nodes=[tree.num_nodes for tree in trees],
        kv_len=kv_len,
        trees=trees,
        dtype=dtype,
        block_tables=tables,
    )


def is_chain(parents: np.ndarray) -> bool:
    """Node j's parent is j - 1 for every node: a chain, as a prompt is."""
    return bool(np.array_equal(parents, np.arange(-1, len(parents) - 1)))


def chain_tree(token_ids: Sequence[int] | np.ndarray) -> DraftTree:
    """A chain: token j's parent is j - 1. Prefill is a chain over the prompt."""
    tokens = np.asarray(token_ids, dtype=np.int32)
    return DraftTree(tokens, np.arange(-1, tokens.shape[0] - 1, dtype=np.int32))
