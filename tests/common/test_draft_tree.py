import numpy as np

from sssd.common.drafting.draft_tree import DraftTree


def tree(tokens, parents, probs=None):
    return DraftTree(np.array(tokens, np.int32), np.array(parents, np.int32),
                     None if probs is None else np.array(probs, np.float32))


def test_equality_is_exact_and_order_sensitive():
    a = tree([5, 1, 2], [-1, 0, 0], [1.0, 0.5, 0.25])
    assert a == tree([5, 1, 2], [-1, 0, 0], [1.0, 0.5, 0.25])
    assert a != tree([5, 2, 1], [-1, 0, 0], [1.0, 0.25, 0.5])  # same tree, other node order
    assert a != tree([5, 1, 2], [-1, 0, 1], [1.0, 0.5, 0.25])
    assert a != tree([5, 1, 2], [-1, 0, 0], [1.0, 0.5, 0.2500001])
    assert a != tree([5, 1, 2], [-1, 0, 0])


def test_depths_and_root_only():
    assert tree([5, 1, 2, 3], [-1, 0, 1, 0]).depths().tolist() == [0, 1, 2, 1]
    root = DraftTree.root_only(7)
    assert root.num_nodes == 1 and root.root_token == 7 and root.parents.tolist() == [-1]
