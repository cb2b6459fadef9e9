"""Everything the forward pass derives from draft trees: inputs, tree positions, attention mask.

The one place where `parents` becomes a mask. Row i of a step holds the draft
tree of one sequence whose first `cache_lens[i]` tokens are already in the KV cache; the tree's
node j goes to cache position `cache_lens[i] + j` and has position id `cache_lens[i] + depth(j)`,
and attends to the cached prefix, its ancestors and itself (SpecInfer-style tree attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.model.kv_cache import KV_ALIGN


@dataclass(frozen=True)
class TreeBatch:
    input_ids: torch.Tensor  # [num_seqs, max_nodes] int64, padded with the root token
    position_ids: torch.Tensor  # [num_seqs, max_nodes] int64
    attention_mask: torch.Tensor  # [num_seqs, 1, max_nodes, kv_len] additive, model dtype
    write_positions: torch.Tensor  # [num_seqs, max_nodes] int64: cache slot of each node
    num_nodes: list[int]  # [num_seqs] real (unpadded) nodes per row
    kv_len: int  # cache positions the step attends over: max(cache_lens) + max_nodes, aligned


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


def build_tree_batch(
    trees: Sequence[DraftTree], cache_lens: Sequence[int], dtype: torch.dtype,
    kv_align: int = KV_ALIGN,
) -> TreeBatch:
    """`kv_align`: the key length of the step is rounded up to a multiple of it (see KV_ALIGN)."""
    num_seqs = len(trees)
    max_nodes = max(tree.num_nodes for tree in trees)
    kv_len = -(-(max(cache_lens) + max_nodes) // kv_align) * kv_align
    input_ids = np.zeros((num_seqs, max_nodes), dtype=np.int64)
    position_ids = np.zeros((num_seqs, max_nodes), dtype=np.int64)
    write_positions = np.zeros((num_seqs, max_nodes), dtype=np.int64)
    allowed = np.zeros((num_seqs, max_nodes, kv_len), dtype=bool)
    for row, (tree, cache_len) in enumerate(zip(trees, cache_lens)):
        n = tree.num_nodes
        input_ids[row, :n] = tree.token_ids
        input_ids[row, n:] = tree.token_ids[0]
        position_ids[row, :n] = cache_len + tree.depths()
        position_ids[row, n:] = cache_len
        # Padding nodes are written past the real ones and never committed.
        write_positions[row] = cache_len + np.arange(max_nodes)
        allowed[row, :, :cache_len] = True
        allowed[row, :n, cache_len : cache_len + n] = ancestor_matrix(tree.parents)
        # A padding query sees only itself, which keeps its softmax finite.
        padding = np.arange(n, max_nodes)
        allowed[row, padding, cache_len + padding] = True
    mask = torch.zeros((num_seqs, 1, max_nodes, kv_len), dtype=dtype)
    mask.masked_fill_(torch.from_numpy(~allowed).unsqueeze(1), torch.finfo(dtype).min)
    return TreeBatch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        attention_mask=mask,
        write_positions=torch.from_numpy(write_positions),
        num_nodes=[tree.num_nodes for tree in trees],
        kv_len=kv_len,
    )


def chain_tree(token_ids: Sequence[int] | np.ndarray) -> DraftTree:
    """A chain: token j's parent is j - 1. Prefill is a chain over the prompt."""
    tokens = np.asarray(token_ids, dtype=np.int32)
    return DraftTree(tokens, np.arange(-1, tokens.shape[0] - 1, dtype=np.int32))
