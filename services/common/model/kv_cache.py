"""A slot-based KV cache for a batch of sequences of different lengths.

Layout: per layer one key and one value tensor of shape
[max_seqs, num_kv_heads, max_len, head_dim]. A running sequence owns one slot; the running batch
always occupies slots [0, num_running) (a finished sequence's slot is filled by moving the last
one into it), so a step over the whole batch attends over the view
`buffer[:num_running, :, :kv_len]` and no per-step copy of the cache is made.

Shared by the verifier's model runner and the speculator's draft runner. A step writes every
node's keys and values at the cache positions its caller gives (the verifier's tree steps at
`cache_len + node_index`, see tree_batch.py); after acceptance `commit` moves the accepted path
to `cache_len + depth`, and the rejected nodes are simply left beyond the new length, to be
overwritten by the next step.

The model calls `update(keys, values, layer_idx)` from inside its attention layers (the hook that
transformers' attention uses for its own caches), so no model code is patched.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from sssd import _kernels
from sssd.common.model.kernel_paths import DTYPE_CODES

# Every step attends over a key length that is a multiple of this, the extra keys masked out.
# A row's attention then does not depend on how long the other rows of the batch are: a CPU
# matmul or softmax reduces a row over the key length in vector blocks plus a tail handled apart,
# so keys that only change the length (masked, weight exactly 0) still moved which products
# were added in the tail, and bf16 logits changed with the batch (test_batch_invariance.py).
KV_ALIGN = 128


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword under which `module`'s forward (a transformers model) takes a cache:
    transformers 5.24 renamed `past_key_values` to `cache` (the old name warns until its removal
    in 5.40), and the earlier 5.x releases know only the old one."""
    parameters = inspect.signature(module.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class SlotKVCache:
    def __init__(self, num_layers: int, max_seqs: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if max_seqs < 1 or max_len < 2:
            raise ValueError("max_seqs must be >= 1 and max_len >= 2")
        # Room for a step's key length rounded up to KV_ALIGN (tree_batch.py) at the very end.
        self.capacity = -(-max_len // KV_ALIGN) * KV_ALIGN
        shape = (max_seqs, num_kv_heads, self.capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_seqs = max_seqs
        self.max_len = max_len
        # The buffers as sssd._kernels reads them (CPU only; None elsewhere): the paged layout
        # with one block per slot, as long as the slot, so that a row's block table is its slot.
        # The buffers are contiguous and never reallocated (`load` and `move` copy into them in
        # place).
        self.layout = _kernels.KvLayout(
            [buffer.data_ptr() for buffer in self.keys],
            [buffer.data_ptr() for buffer in self.values], max_seqs, self.capacity,
            num_kv_heads, head_dim, DTYPE_CODES[dtype]) \
            if self.keys[0].device.type == "cpu" and dtype in DTYPE_CODES else None
        self.lengths = [0] * max_seqs  # [max_seqs] committed tokens per slot
        # Set by `begin_step` for the forward pass in flight.
        self._rows: slice | None = None
        self._write_positions: torch.Tensor | None = None  # [num_rows, num_nodes]
        self._row_index: torch.Tensor | None = None  # [num_rows, 1]
        self._kv_len = 0

    # --- the forward pass --------------------------------------------------------------------

    def begin_step(self, first_slot: int, num_rows: int, write_positions: torch.Tensor,
                   kv_len: int) -> None:
        """Slots [first_slot, first_slot + num_rows) take part in the next forward pass."""
        if kv_len > self.capacity:
            raise ValueError(f"step needs {kv_len} cache positions, the cache holds "
                             f"{self.capacity}")
        self._rows = slice(first_slot, first_slot + num_rows)
        self._write_positions = write_positions
        # [num_rows, 1], once per step, where the positions are (the cache's device)
        self._row_index = torch.arange(num_rows, device=write_positions.device).unsqueeze(1)
        self._kv_len = kv_len

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: [num_rows, num_kv_heads, num_nodes, head_dim] of the step's nodes.

        Returns the keys and values to attend over: [num_rows, num_kv_heads, kv_len, head_dim].
        """
        assert self._rows is not None, "begin_step must come before the forward pass"
        key_buffer = self.keys[layer_idx][self._rows]  # [num_rows, heads, max_len, head_dim]
        value_buffer = self.values[layer_idx][self._rows]
        rows = self._row_index
        # Advanced indexing puts (row, node) first: [num_rows, num_nodes, heads, head_dim].
        key_buffer[rows, :, self._write_positions] = keys.transpose(1, 2)
        value_buffer[rows, :, self._write_positions] = values.transpose(1, 2)
        return key_buffer[:, :, : self._kv_len], value_buffer[:, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def begin_segment(self, segment) -> None:
        """begin_step for a decoder Segment: its rows are slots [first_slot, ...)."""
        batch = segment.batch
        self.begin_step(segment.first_slot, batch.input_ids.shape[0], batch.write_positions,
                        batch.kv_len)

    def segment_tables(self, segment) -> torch.Tensor:
        """[num_rows, 1] int32: a segment's rows own one block each (as kernels read the slot
        cache: kv_layout.h), their slot."""
        first, num_rows = segment.first_slot, segment.batch.input_ids.shape[0]
        return torch.arange(first, first + num_rows, dtype=torch.int32).unsqueeze(1)

    def segment_kv(self, layer: int, segment) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a segment's slots up to its kv_len: two [num_rows,
        num_kv_heads, kv_len, head_dim] views (no copy)."""
        first, num_rows = segment.first_slot, segment.batch.input_ids.shape[0]
        kv_len = segment.batch.kv_len
        if kv_len > self.capacity or first < 0 or first + num_rows > self.max_seqs:
            raise ValueError(f"slots [{first}, {first + num_rows}) x {kv_len} positions: the "
                             f"cache holds {self.max_seqs} x {self.capacity}")
        rows = slice(first, first + num_rows)
        return self.keys[layer][rows, :, :kv_len], self.values[layer][rows, :, :kv_len]

    # --- after the forward pass ----------------------------------------------------------------

    def commit(self, slots: Sequence[int], accepted_nodes: Sequence[Sequence[int]]) -> None:
        """Keeps the root and the accepted path of each slot's tree, in path order.

        `accepted_nodes[i]` are node indices of slot `slots[i]`'s tree along the accepted path,
        root excluded. The root stays where it was written (node 0 at the old length).
        """
        rows, sources, targets, lengths = [], [], [], []
        for slot, nodes in zip(slots, accepted_nodes):
            base = self.lengths[slot]
            for depth, node in enumerate(nodes, start=1):
                if node != depth:  # already in place when the path is a prefix of the layout
                    rows.append(slot)
                    sources.append(base + node)
                    targets.append(base + depth)
            lengths.append((slot, base + 1 + len(nodes)))
        if any(position >= self.capacity for position in (*sources, *targets)):
            raise IndexError(f"a move lies outside the cache's {self.capacity} positions a slot")
        if rows and self.layout is not None:
            # One call for every layer's keys and values, where 2 x num_layers indexed copies
            # were a visible part of a small model's step (bench/results/2026-12-01-xeon-10).
            # Positions of the whole cache: slot * capacity + position.
            capacity = self.capacity
            _kernels.move_positions(self.layout, [r * capacity + p for r, p in zip(rows, sources)],
                                    [r * capacity + p for r, p in zip(rows, targets)])
        elif rows:
            # [3, num_moves]: to the cache's device in one copy
            indices = torch.tensor((rows, sources, targets)).to(self.keys[0].device,
                                                                non_blocking=True)
            row_index, source_index, target_index = indices
            for buffer in (*self.keys, *self.values):
                # The right-hand side is gathered into a new tensor first, so overlaps are safe.
                buffer[row_index, :, target_index] = buffer[row_index, :, source_index]
        # Only once every move is made: a refused one leaves the slots' lengths as they were.
        for slot, length in lengths:
            self.lengths[slot] = length

    def set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length

    def export(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the slot's committed keys and values: two [num_layers, num_kv_heads,
        length, head_dim] tensors (prefill/decode handoff)."""
        length = self.lengths[slot]
        keys = torch.stack([buffer[slot, :, :length] for buffer in self.keys])
        values = torch.stack([buffer[slot, :, :length] for buffer in self.values])
        return keys, values

    def load(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes keys and values made by `export` (of another cache) into `slot`."""
        expected = (len(self.keys), *self.keys[0].shape[1:2], keys.shape[2],
                    self.keys[0].shape[3])
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise ValueError(f"KV of shape {tuple(keys.shape)} does not fit this cache "
                             f"(expected {expected})")
        if keys.dtype != self.keys[0].dtype:
            raise ValueError(f"KV of dtype {keys.dtype}, this cache holds {self.keys[0].dtype}")
        length = keys.shape[2]
        if length >= self.max_len:
            raise ValueError(f"KV of {length} positions does not fit {self.max_len}")
        for layer in range(len(self.keys)):
            self.keys[layer][slot, :, :length] = keys[layer]
            self.values[layer][slot, :, :length] = values[layer]
        self.lengths[slot] = length

    def move(self, source_slot: int, target_slot: int) -> None:
        """Copies a sequence's cache to another slot (compaction after a sequence finishes)."""
        length = self.lengths[source_slot]
        for buffer in (*self.keys, *self.values):
            buffer[target_slot, :, :length] = buffer[source_slot, :, :length]
        self.lengths[target_slot] = length
        self.lengths[source_slot] = 0
