"""Tests of sssd.verifier.engine.acceptance, greedy: hand-built trees, malformed trees, and
verification against Hugging Face's greedy `generate` on a tiny Llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from sssd.verifier.engine.acceptance import (
    AcceptResult,
    TreeIndex,
    accept_greedy,
)

from support.tiny_llama import (
    CONTEXT,
    VOCAB_SIZE,
    tiny_llama,
    tree_logits,
)


@pytest.fixture(scope="module")
def target_model() -> LlamaForCausalLM:
    return tiny_llama(seed=0)


def test_greedy_chain_fully_accepted_gets_bonus_after_leaf():
    result = accept_greedy(np.array([9, 1, 2, 3]), np.array([-1, 0, 1, 2]),
                           torch.tensor([1, 2, 3, 7]))
    assert result == AcceptResult([1, 2, 3], [1, 2, 3], 7)
    assert result.emitted_tokens == [1, 2, 3, 7] and result.num_accepted == 3


def test_greedy_divergence_at_first_level_accepts_nothing():
    result = accept_greedy(np.array([9, 1, 2, 3]), np.array([-1, 0, 0, 1]),
                           torch.tensor([5, 3, 0, 0]))
    assert result == AcceptResult([], [], 5)
    assert result.emitted_tokens == [5]


def test_greedy_second_child_matches():
    result = accept_greedy(np.array([9, 4, 6, 8]), np.array([-1, 0, 0, 2]),
                           torch.tensor([6, 0, 1, 0]))
    assert result == AcceptResult([2], [6], 1)


def test_greedy_deep_tree():
    #            0:(9)
    #      1:(4)        2:(6)
    #   3:(1) 4:(2)      5:(7)
    #   6:(3) 7:(5) 8:(1)
    #         9:(8)
    token_ids = np.array([9, 4, 6, 1, 2, 7, 3, 5, 1, 8])
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 4, 4, 7])
    # Root wants 4, node 1 wants 2 (its second child), node 4 wants 5, node 7 wants 8 (a leaf),
    # after which the target says 11.
    argmax = torch.tensor([4, 2, 0, 0, 5, 0, 0, 8, 0, 11])
    assert accept_greedy(token_ids, parents, argmax) == AcceptResult([1, 4, 7, 9], [4, 2, 5, 8], 11)
    # Node 4 wanting 1 takes node 8, a leaf: bonus from node 8.
    argmax[4], argmax[8] = 1, 6
    assert accept_greedy(token_ids, parents, argmax) == AcceptResult([1, 4, 8], [4, 2, 1], 6)


def test_greedy_root_only_and_repeated_sibling_tokens():
    root_only = accept_greedy(np.array([9]), np.array([-1]), torch.tensor([3]))
    assert root_only == AcceptResult([], [], 3)
    # Two siblings with token 4: the first in tree order is taken.
    result = accept_greedy(np.array([9, 4, 4, 1]), np.array([-1, 0, 0, 2]),
                           np.array([4, 0, 1, 0]))
    assert result == AcceptResult([1], [4], 0)


def test_greedy_equals_plain_greedy_generate(target_model):
    generated = target_model.generate(torch.tensor([CONTEXT]), do_sample=False,
                                      max_new_tokens=4, min_new_tokens=4)[0, len(CONTEXT):]
    g1, g2, g3, g4 = generated.tolist()
    other = [t for t in range(VOCAB_SIZE) if t not in (g1, g2, g3)]
    trees = {
        # Stops at g2's wrong child: emits g1, g2 and the target's g3.
        3: ([CONTEXT[-1], other[0], g1, g2, other[1], other[2]], [-1, 0, 0, 2, 2, 3]),
        # The whole greedy chain is drafted: emits g1, g2, g3 and the bonus g4.
        4: ([CONTEXT[-1], g1, other[0], g2, g3], [-1, 0, 1, 1, 3]),
    }
    for num_emitted, (token_ids, parents) in trees.items():
        tree = TreeIndex(np.array(token_ids), np.array(parents))
        argmax = tree_logits(target_model, tree).argmax(dim=-1)  # [num_nodes]
        result = accept_greedy(np.array(token_ids), np.array(parents), argmax)
        assert result.emitted_tokens == generated[:num_emitted].tolist()


@pytest.mark.parametrize(
    ("token_ids", "parents", "message"),
    [
        ([1, 2], [0, 0], "root"),
        ([1, 2, 3], [-1, 2, 0], "parents before children"),
        ([1, 2, 3], [-1, 0], "same non-zero length"),
        ([], [], "same non-zero length"),
    ],
)
def test_malformed_trees_raise(token_ids, parents, message):
    with pytest.raises(ValueError, match=message):
        accept_greedy(np.array(token_ids), np.array(parents), np.zeros(len(token_ids)))
