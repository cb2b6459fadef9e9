"""Structured output in the engine: a request's grammar (grammar.py) as a mask of the target's
logits at every node of its draft tree.

Node j's mask is the grammar's state after the answer so far and the draft tokens on the path to
j. Masking each node's row by its own path keeps verification lossless for the same reason the
penalties do (logits_processing.py): the token chosen after j is the one plain constrained
decoding would choose had it generated that path. And a draft node whose token its parent's
mask forbids can never be accepted (its probability is zero there), so it is dropped, with its
subtree, before the forward pass: a constrained tree costs only the nodes that can win.

The tree is walked depth first on one llguidance matcher, consuming a node's token on the way
down and rolling it back on the way up; the matcher is left at the answer's state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import numpy as np
import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.verifier.engine.grammar import Grammar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Bit b of byte value v, for unpacking llguidance's bitmasks: [256, 8] bool.
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()


class GrammarCompiler:
    """Makes each constrained request's matcher. The tokenizer llguidance reads is built at the
    first constrained request (0.5 s for a 49k vocabulary), so engines never asked for one pay
    nothing."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: Seq[int]) -> None:
        """`vocab_size`: the model's logits' width (it may exceed the tokenizer's: ids past the
        tokenizer's are never allowed)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids)
        return self._ll_tokenizer

    def constraint(self, grammar: Grammar) -> Constraint:
        matcher = llguidance.LLMatcher(self.llguidance_tokenizer, grammar.llguidance_grammar,
                                       log_level=0)
        if matcher.is_error():  # validated at the boundary; a tokenizer-specific failure
            raise ValueError(f"the grammar cannot be used with this tokenizer: "
                             f"{matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One sequence's grammar state: the answer so far has been consumed."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._num_words = (vocab_size + 31) // 32

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and takes nothing more (only EOS)."""
        return self._matcher.is_stopped()

    def next_mask(self) -> torch.Tensor:
        """[1, vocab_size] bool: the tokens the grammar allows next."""
        bitmask = np.empty((1, self._num_words), dtype=np.int32)  # [1, num_words]
        self._fill(bitmask[0])
        return self._unpacked(bitmask)

    def tree(self, tree: DraftTree) -> tuple[DraftTree, torch.Tensor]:
        """The tree without the nodes the grammar rejects (a rejected node's subtree goes with
        it), and the mask after each kept node: [num_kept, vocab_size] bool, in the kept tree's
        order."""
        parents = tree.parents.tolist()
        token_ids = tree.token_ids.tolist()
        children: list[list[int]] = [[] for _ in parents]  # [num_nodes]
        for node in range(1, len(parents)):
            children[parents[node]].append(node)
        bitmask = np.zeros((len(parents), self._num_words), dtype=np.int32)  # [num_nodes, ...]
        kept = [False] * len(parents)
        kept[0] = True
        stack: list[tuple[int, int]] = [(0, 0)]  # (node, next child to try) on the path
        self._fill(bitmask[0])
        while stack:
            node, index = stack[-1]
            if index == len(children[node]):
                stack.pop()
                if stack:
                    self._matcher.rollback(1)
                continue
            stack[-1] = (node, index + 1)
            child = children[node][index]
            token = token_ids[child]
            if not _allows(bitmask[node], token) or not self._matcher.consume_token(token):
                continue
            kept[child] = True
            self._fill(bitmask[child])
            stack.append((child, 0))
        order = [node for node in range(len(parents)) if kept[node]]
        masks = self._unpacked(bitmask[order])  # [num_kept, vocab_size]
        if len(order) == len(parents):
            return tree, masks
        new_index = {node: i for i, node in enumerate(order)}
        new_parents = np.array([-1] + [new_index[parents[n]] for n in order[1:]],
                               dtype=np.int32)
        pruned = DraftTree(tree.token_ids[order], new_parents,
                           None if tree.probs is None else tree.probs[order])
        return pruned, masks

    def advance(self, token_ids: Seq[int]) -> None:
        """The answer grew by these tokens (each one the masks allowed). A complete grammar
        takes no more: the EOS that ends the answer after it is not consumed."""
        if self._matcher.is_stopped():
            return
        if token_ids and not self._matcher.consume_tokens(list(token_ids)):
            # Only a token the mask forbade gets here (a resumed answer from another worker
            # with other settings): the answer goes on unconstrained rather than fail.
            logger.warning("the grammar rejected the answer's tokens (%s); the rest of this "
                           "answer is unconstrained", self._matcher.get_error())

    def _fill(self, row: np.ndarray) -> None:
        """The grammar's mask at the matcher's state into `row` [num_words] int32."""
        if self._matcher.is_error():
            row.fill(-1)  # every token: an answer whose grammar failed goes on unconstrained
            return
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def _unpacked(self, bitmask: np.ndarray) -> torch.Tensor:
        """[num_rows, num_words] int32 bitmasks as [num_rows, vocab_size] bool."""
        packed = torch.from_numpy(np.ascontiguousarray(bitmask).view(np.uint8))
        return _BITS[packed.long()].flatten(1)[:, : self.vocab_size]


def _allows(row: np.ndarray, token: int) -> bool:
    return 0 <= token < row.shape[0] * 32 and bool((int(row[token >> 5]) >> (token & 31)) & 1)
