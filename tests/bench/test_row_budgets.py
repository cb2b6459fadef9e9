"""The allocations of bench/row_budgets.py: how a step's b x s_q nodes are shared out."""


import numpy as np

from bench.row_budgets import share
from sssd.common.drafting.draft_tree import DraftTree


def chain(probs: list[float]) -> DraftTree:
    """A best-first chain whose nodes have these scores (root first)."""
    n = len(probs)
    return DraftTree(np.arange(n, dtype=np.int32), np.arange(-1, n - 1, dtype=np.int32),
                     np.asarray(probs, dtype=np.float32))


def test_uniform_gives_every_row_the_budget_or_its_whole_tree():
    trees = [chain([1, 0.9, 0.8, 0.7, 0.6]), chain([1, 0.5])]
    assert share(trees, 8, "uniform", [1.0, 1.0]) == [4, 2]


def test_global_takes_the_best_scored_nodes_of_all_rows_as_prefixes():
    trees = [chain([1, 0.9, 0.2, 0.1]), chain([1, 0.8, 0.7, 0.05])]
    # 6 nodes: both roots, then 0.9 (row 0), 0.8 and 0.7 (row 1), then 0.2 (row 0)
    assert share(trees, 6, "global", [1.0, 1.0]) == [3, 3]
    assert share(trees, 5, "global", [1.0, 1.0]) == [2, 3]
    # a row's history scales its scores: row 0 accepted nothing lately
    assert share(trees, 5, "history", [0.05, 1.0]) == [1, 4]


def test_split_gives_the_rows_that_accepted_more_lately_more_nodes():
    trees = [chain([1] + [0.5] * 15) for _ in range(4)]
    counts = share(trees, 16, "split", [0.1, 0.9, 0.5, 0.2])
    assert counts == [2, 6, 6, 2]
    assert sum(counts) <= 16
