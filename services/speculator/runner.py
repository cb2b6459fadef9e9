"""Runs the draft model over arbitrary nodes of per-sequence token trees.

The speculator's forward passes are not whole draft trees: a round first runs the chain of
tokens the verifier is checking, then grows many short branches off that chain one depth at a
time (one forward per depth for all branches of all sequences). A node is therefore described by
where its KV goes and what it may attend to:

- `write`: its cache position in the sequence's slot;
- `visible_end`: it attends to every cache position below this (the committed context and, for
  a branch, the chain up to its attachment point);
- `extra`: further positions it attends to (its branch ancestors, itself included).

Branches share the chain's KV in place: no prefix is copied per branch.

The forward pass is the project's own (sssd.common.model.decoder, the verifier's: weights packed
once, its own matrix products) for the Llama and Qwen2 families, through the transformers model
for any other (`model_impl`, as the verifier's); on a CPU without bfloat16 instructions the
difference is large (bench/results/2026-11-29-zen3-ssd).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sssd.common.model.decoder import MaskedNodes, decoder_for
from sssd.common.model.kv_cache import SlotKVCache, cache_keyword

# The step's key length is rounded up to this (fewer distinct shapes; no invariance needed).
_KV_ALIGN = 32


@dataclass(frozen=True)
class Node:
    token: int
    position: int  # position id
    write: int  # cache position in the slot
    visible_end: int  # attends to cache positions [0, visible_end) ...
    extra: tuple[int, ...]  # ... and to these (ancestors past visible_end, itself included)


def chain_nodes(tokens: Sequence[int], start: int) -> list[Node]:
    """Tokens written at cache positions start, start + 1, ..., each seeing all before it."""
    return [Node(int(token), start + i, start + i, start + i, (start + i,))
            for i, token in enumerate(tokens)]


class DraftRunner:
    """The draft model and its slot KV cache: slot s holds one sequence."""

    def __init__(self, model: torch.nn.Module, max_seqs: int, max_len: int,
                 device: torch.device, model_impl: str = "auto") -> None:
        """`model_impl`: which forward pass (sssd.common.model.impls.MODEL_IMPLS)."""
        config = model.config
        self.model = model
        self.own = decoder_for(model, model_impl)  # None: the transformers forward
        self.device = device
        self.dtype = next(model.parameters()).dtype
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.cache = SlotKVCache(num_layers=config.num_hidden_layers, max_seqs=max_seqs,
                                 num_kv_heads=config.num_key_value_heads, max_len=max_len,
                                 head_dim=head_dim, dtype=self.dtype, device=device)
        self.capacity = self.cache.capacity
        self.decoder = model.base_model  # the transformer without its head
        self._cache_keyword = cache_keyword(self.decoder)
        self.head = model.get_output_embeddings()
        self.vocab_size = self.head.weight.shape[0]
        # Per slot: one past the highest cache position holding KV still needed. Padding
        # nodes of a step are written above it.
        self._high = [0] * max_seqs

    @torch.inference_mode()
    def forward(self, nodes: Mapping[int, Sequence[Node]],
                keep: Mapping[int, Sequence[int]]) -> dict[int, torch.Tensor]:
        """One forward pass over `nodes` ({slot: nodes}); returns {slot: float32 logits
        [len(keep[slot]), vocab_size]} at the node indices `keep[slot]`.

        Slots between the lowest and highest given one that have no nodes take part with one
        padding node each (written above their live KV, never read)."""
        first, last = min(nodes), max(nodes)
        num_rows = last - first + 1
        width = max(max((len(n) for n in nodes.values()), default=1), 1)
        rows: list[list[Node]] = []
        for slot in range(first, last + 1):
            real = list(nodes.get(slot, ()))
            top = max([self._high[slot], *(n.write + 1 for n in real)])
            # Padding: attends only to itself, written past everything real.
            rows.append(real + [Node(0, 0, top + i, 0, (top + i,))
                                for i in range(width - len(real))])
        kv_len = max(node.write + 1 for row in rows for node in row)
        kv_len = -(-kv_len // _KV_ALIGN) * _KV_ALIGN
        if kv_len > self.capacity:
            raise ValueError(f"draft step needs {kv_len} cache positions, the cache holds "
                             f"{self.capacity}")
        input_ids = np.zeros((num_rows, width), dtype=np.int64)
        position_ids = np.zeros((num_rows, width), dtype=np.int64)
        write = np.zeros((num_rows, width), dtype=np.int64)
        allowed = np.zeros((num_rows, width, kv_len), dtype=bool)
        for r, row in enumerate(rows):
            for i, node in enumerate(row):
                input_ids[r, i] = node.token
                position_ids[r, i] = node.position
                write[r, i] = node.write
                allowed[r, i, : node.visible_end] = True
                allowed[r, i, list(node.extra)] = True
        mask = torch.zeros((num_rows, 1, width, kv_len), dtype=self.dtype)
        mask.masked_fill_(torch.from_numpy(~allowed).unsqueeze(1), torch.finfo(self.dtype).min)
        device = self.device
        write_positions = torch.from_numpy(write).to(device)
        self.cache.begin_step(first, num_rows, write_positions, kv_len)
        step = MaskedNodes(torch.from_numpy(input_ids).to(device),
                           torch.from_numpy(position_ids).to(device), mask.to(device))
        if self.own is not None:  # [num_rows, width, hidden], after the final norm
            hidden = self.own.hidden_states(step, self.cache)
            head = self.own.head
        else:
            hidden = self.decoder(input_ids=step.input_ids, position_ids=step.position_ids,
                                  attention_mask=step.attention_mask, use_cache=True,
                                  **{self._cache_keyword: self.cache}).last_hidden_state
            head = self.head
        for slot, slot_nodes in nodes.items():
            if slot_nodes:
                self._high[slot] = max(self._high[slot], max(n.write for n in slot_nodes) + 1)
        out: dict[int, torch.Tensor] = {}
        for slot, indices in keep.items():
            if indices:
                picked = hidden[slot - first, list(indices)]  # [num_kept, hidden]
                out[slot] = head(picked).float().cpu()  # [num_kept, vocab_size]
        return out

    def set_live_end(self, slot: int, end: int) -> None:
        """KV above `end` in `slot` is no longer needed (padding may overwrite it)."""
        self._high[slot] = end
