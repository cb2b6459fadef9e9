"""Tiny randomly initialized Llamas and the draft-tree logits they give, for the acceptance
tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sssd.verifier.engine.acceptance import TreeIndex

VOCAB_SIZE = 12
CONTEXT = [3, 8, 1, 5]  # the root of every tree is the last context token


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """A randomly initialized 2-layer Llama; the large init spreads its distributions out."""
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=32, initializer_range=0.5,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def next_token_logits(model: LlamaForCausalLM, sequences: list[list[int]]) -> torch.Tensor:
    """Logits [num_seqs, vocab_size] after each of `sequences` (all of one length)."""
    return model(input_ids=torch.tensor(sequences)).logits[:, -1].float()


def path_tokens(tree: TreeIndex, node: int) -> list[int]:
    """The draft tokens from the root's child down to `node` (empty for the root)."""
    tokens = []
    while node > 0:
        tokens.append(tree.token_ids[node])
        node = tree.parents[node]
    return tokens[::-1]


def tree_logits(model: LlamaForCausalLM, tree: TreeIndex) -> torch.Tensor:
    """Target logits [num_nodes, vocab_size] at every node: the model run on context + path."""
    return torch.cat([next_token_logits(model, [CONTEXT + path_tokens(tree, node)])
                      for node in range(tree.num_nodes)])
