"""The verifier's KV cache: a pool of fixed-size blocks, each sequence's positions in the blocks
of its block table (verifier/engine/block_manager.py hands them out).

Layout: per layer one key and one value tensor [num_blocks, num_kv_heads, block_size,
head_dim]; position p of a row is at offset p % block_size of block block_table[p //
block_size]. The buffers are allocated once, sized by memory, on 2 MiB pages where the OS grants
them (huge_pages.py): a step reads its rows' blocks wherever they lie, and on 4 KiB pages each
block read from memory would also cost a TLB miss. On the CPU the kernels read the buffers
through `layout` (sssd._kernels.KvLayout) and each step's block tables; elsewhere, and for the
transformers forward, `update` scatters a step's keys and values into their blocks and gathers
the rows' keys and values into contiguous tensors.

A step writes every node's keys and values at the positions its caller gives (a tree's node j
at `cache_len + j`, tree_batch.py); `move` keeps an accepted path (the runner's commit), and
rejected nodes are simply overwritten by the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sssd import _kernels
from sssd.common.model import huge_pages
from sssd.common.model.kernel_paths import DTYPE_CODES
from sssd.common.model.kv_cache import KV_ALIGN


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape`; on the CPU in a fresh mapping advised for huge pages."""
    if device.type != "cpu" or not huge_pages.enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    elements = 1
    for size in shape:
        elements *= size
    element_size = torch.empty(0, dtype=dtype).element_size()
    raw = huge_pages.empty_on_huge_pages(elements * element_size)
    return raw.view(dtype).view(shape).zero_()


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 max_positions: int = 2048) -> None:
        """`max_positions`: the most positions a sequence may reach (the rotary tables are
        made for them)."""
        if num_blocks < 1 or block_size < 16 or block_size % 16:
            raise ValueError(f"need num_blocks >= 1 and block_size a multiple of 16, got "
                             f"{num_blocks} blocks of {block_size}")
        device = torch.device(device)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.keys = [_buffer(shape, dtype, device) for _ in range(num_layers)]
        self.values = [_buffer(shape, dtype, device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        # A step attends over up to this many positions, rounded up to KV_ALIGN (tree_batch.py).
        self.capacity = -(-max_positions // KV_ALIGN) * KV_ALIGN
        self.layout = _kernels.KvLayout(
            [buffer.data_ptr() for buffer in self.keys],
            [buffer.data_ptr() for buffer in self.values], num_blocks, block_size,
            num_kv_heads, head_dim, DTYPE_CODES[dtype]) \
            if device.type == "cpu" and dtype in DTYPE_CODES else None
        # Set by `begin_step` for the forward pass in flight (the PyTorch path).
        self._tables: torch.Tensor | None = None  # [num_rows, max_blocks] int64
        self._write_blocks: torch.Tensor | None = None  # [num_rows, num_nodes]
        self._write_offsets: torch.Tensor | None = None
        self._kv_len = 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values one position takes, over every layer."""
        return 2 * len(self.keys) * self.num_kv_heads * self.head_dim * \
            self.keys[0].element_size()

    # --- the PyTorch forward (transformers' cache hook) -----------------------------------------

    def begin_step(self, block_tables: torch.Tensor, write_positions: torch.Tensor,
                   kv_len: int) -> None:
        """block_tables [num_rows, max_blocks] int32 (each row's blocks, padded with any valid
        block), write_positions [num_rows, num_nodes]: where the next forward pass writes."""
        if kv_len > block_tables.shape[1] * self.block_size:
            raise ValueError(f"step needs {kv_len} positions, its block tables hold "
                             f"{block_tables.shape[1] * self.block_size}")
        tables = block_tables.to(self.keys[0].device).long()
        self._tables = tables
        positions = write_positions.to(tables.device)
        rows = torch.arange(tables.shape[0], device=tables.device).unsqueeze(1)
        self._write_blocks = tables[rows, positions // self.block_size]
        self._write_offsets = positions % self.block_size
        self._kv_len = kv_len

    def begin_segment(self, segment) -> None:
        """begin_step for a decoder Segment (its batch carries its rows' block tables)."""
        batch = segment.batch
        self.begin_step(batch.block_tables, batch.write_positions, batch.kv_len)

    def segment_tables(self, segment) -> torch.Tensor:
        return segment.batch.block_tables

    def segment_kv(self, layer: int, segment) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment's rows' keys and values up to its kv_len, gathered from their blocks."""
        return self.gather(layer, segment.batch.block_tables, segment.batch.kv_len)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: [num_rows, num_kv_heads, num_nodes, head_dim] of the step's nodes.

        Returns the keys and values to attend over: [num_rows, num_kv_heads, kv_len, head_dim].
        """
        assert self._tables is not None, "begin_step must come before the forward pass"
        blocks, offsets = self._write_blocks, self._write_offsets
        # Advanced indexing puts (row, node) first: [num_rows, num_nodes, heads, head_dim].
        self.keys[layer_idx][blocks, :, offsets] = keys.transpose(1, 2)
        self.values[layer_idx][blocks, :, offsets] = values.transpose(1, 2)
        return self.gather(layer_idx, self._tables, self._kv_len)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def gather(self, layer: int, block_tables: torch.Tensor,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' first `kv_len` positions of layer `layer`, contiguous: two [num_rows,
        num_kv_heads, kv_len, head_dim] copies."""
        tables = block_tables.to(self.keys[0].device).long()
        num_blocks = -(-kv_len // self.block_size)
        if num_blocks > tables.shape[1]:
            raise ValueError(f"{kv_len} positions exceed the block tables' "
                             f"{tables.shape[1] * self.block_size}")
        used = tables[:, :num_blocks]
        num_rows = used.shape[0]

        def rows(buffer: torch.Tensor) -> torch.Tensor:
            # [rows, blocks, heads, block_size, d] -> [rows, heads, blocks * block_size, d]
            gathered = buffer[used].permute(0, 2, 1, 3, 4)
            return gathered.reshape(num_rows, self.num_kv_heads, -1, self.head_dim)[:, :, :kv_len]
        return rows(self.keys[layer]), rows(self.values[layer])

    # --- after the forward pass ----------------------------------------------------------------

    def move(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copies cache position sources[i] to targets[i] in every layer's keys and values (a
        position: block * block_size + offset), all sources read before any target is written.
        Raises IndexError, having moved nothing, for a position outside the cache."""
        if not sources:
            return
        limit = self.num_blocks * self.block_size
        if any(not 0 <= p < limit for p in (*sources, *targets)):
            raise IndexError(f"a move lies outside the cache's {limit} positions")
        if self.layout is not None:
            _kernels.move_positions(self.layout, list(sources), list(targets))
            return
        index = torch.tensor((sources, targets)).to(self.keys[0].device, non_blocking=True)
        size = self.block_size
        for buffer in (*self.keys, *self.values):
            # The right-hand side is gathered into a new tensor first, so overlaps are safe.
            buffer[index[1] // size, :, index[1] % size] = \
                buffer[index[0] // size, :, index[0] % size]

    def export(self, blocks: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of a sequence's first `length` positions (its `blocks` in order): two
        [num_layers, num_kv_heads, length, head_dim] tensors (the prefill/decode handoff)."""
        table = torch.tensor([list(blocks)], dtype=torch.int64)
        pairs = [self.gather(layer, table, length) for layer in range(len(self.keys))]
        return torch.stack([k[0] for k, _ in pairs]), torch.stack([v[0] for _, v in pairs])

    def load(self, blocks: Sequence[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes keys and values made by `export` (of another cache) into `blocks`."""
        expected = (len(self.keys), self.num_kv_heads, keys.shape[2], self.head_dim)
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise ValueError(f"KV of shape {tuple(keys.shape)} does not fit this cache "
                             f"(expected {expected})")
        if keys.dtype != self.dtype:
            raise ValueError(f"KV of dtype {keys.dtype}, this cache holds {self.dtype}")
        length = keys.shape[2]
        if len(blocks) * self.block_size < length:
            raise ValueError(f"KV of {length} positions does not fit {len(blocks)} blocks")
        positions = torch.arange(length, device=self.keys[0].device)
        table = torch.tensor(list(blocks), dtype=torch.int64, device=positions.device)
        where, offsets = table[positions // self.block_size], positions % self.block_size
        for layer in range(len(self.keys)):
            # [length, heads, d] into (block, offset) pairs
            self.keys[layer][where, :, offsets] = keys[layer].transpose(0, 1)
            self.values[layer][where, :, offsets] = values[layer].transpose(0, 1)
