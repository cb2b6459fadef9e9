"""The one draft-tree shape of the project, shared by the drafter, the verifier and the protos.

A draft tree is `token_ids` + `parents` (+ `probs`), parents before children. Node 0 is the root:
the last accepted token of the sequence, with parent -1. Everything else (attention mask, position
ids, paths) is derived from `parents` on the verifier side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class DraftTree:
    token_ids: np.ndarray  # [num_nodes] int32; token_ids[0] is the last accepted token
    parents: np.ndarray  # [num_nodes] int32; -1 for the root, else an index < own index
    probs: np.ndarray | None = None  # [num_nodes] float32; drafter's estimate, 1.0 at the root

    def __eq__(self, other: object) -> bool:
        """Exact equality: same tokens, same parents in the same order, same probs."""
        if not isinstance(other, DraftTree):
            return NotImplemented
        if (self.probs is None) != (other.probs is None):
            return False
        return (np.array_equal(self.token_ids, other.token_ids)
                and np.array_equal(self.parents, other.parents)
                and (self.probs is None or np.array_equal(self.probs, other.probs)))

    __hash__ = None  # mutable arrays inside: not hashable

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def root_token(self) -> int:
        return int(self.token_ids[0])

    def depths(self) -> np.ndarray:
        """[num_nodes] int32: 0 for the root, parent's depth + 1 otherwise."""
        depths = np.zeros(self.num_nodes, dtype=np.int32)
        for node in range(1, self.num_nodes):
            depths[node] = depths[self.parents[node]] + 1
        return depths

    @classmethod
    def root_only(cls, token_id: int) -> "DraftTree":
        """The tree of plain autoregressive decoding: the last accepted token alone."""
        return cls(
            token_ids=np.array([token_id], dtype=np.int32),
            parents=np.array([-1], dtype=np.int32),
            probs=np.ones(1, dtype=np.float32),
        )

    def prefix(self, num_nodes: int) -> "DraftTree":
        """The first `num_nodes` nodes: a tree, as parents come before children. For the
        drafters that insert nodes best-first (docs/algorithm.md, "Output") it is the tree they
        would have drafted at that budget."""
        if num_nodes >= self.num_nodes:
            return self
        if num_nodes < 1:
            raise ValueError(f"a tree keeps at least its root, asked for {num_nodes} nodes")
        return DraftTree(self.token_ids[:num_nodes], self.parents[:num_nodes],
                         None if self.probs is None else self.probs[:num_nodes])
