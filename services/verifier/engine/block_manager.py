"""The paged KV cache's blocks: which are free, who holds each, and the prefix cache.

A sequence's keys and values live in fixed-size blocks (kv_cache.PagedKVCache) listed in its
block table; position p is at offset p % block_size of block block_table[p // block_size].
Blocks are handed out lowest number first, so a prompt's blocks are mostly one run of memory.

Prefix caching: a full block is keyed by the hash of its tokens and of the key of the block
before it (and the model, dtype and block size, `salt`), so a key names a whole prefix. When a
sequence's block fills, it is registered under its key; a later sequence whose prompt starts
with the same tokens takes the registered blocks instead of computing them again (their
reference count goes up; nobody writes into a full block). A block nobody holds stays cached,
least recently released evicted first when fresh blocks run out. This is exact because the KV
cache is a pure function of the token prefix: every position's keys and values are computed the
same way, bit for bit, whether they were prefilled in one pass, in chunks, or decoded a step at
a time inside draft trees (the kernels' tests hold every attention path to that).

Example, blocks of 4 tokens:

    manager = BlockManager(num_blocks=8, block_size=4)
    first = manager.admit([1, 2, 3, 4, 5, 6])   # nothing cached: computes all 6 tokens
    manager.ensure(first, 6)                    # blocks 0 and 1
    tokens = [1, 2, 3, 4, 5, 6]
    manager.register_full(first, 6, lambda p: tokens[p:])  # block 0 = tokens 1-4 now cached
    second = manager.admit([1, 2, 3, 4, 9])     # block 0 again: second.num_cached == 4
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """One sequence's blocks in position order and what they hold."""

    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading positions whose keys and values are in the cache
    hashes: list[bytes] = field(default_factory=list)  # keys of its leading full blocks

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


@dataclass
class PrefixStats:
    """Prefix-cache lookups of prompts, in tokens (vLLM's prefix_cache_queries / _hits)."""

    queries: int = 0
    hits: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, salt: bytes = b"",
                 enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._salt = hashlib.blake2b(salt + block_size.to_bytes(4, "little"),
                                     digest_size=16).digest()
        self._free = list(range(num_blocks))  # a heap: the lowest-numbered free block first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # block -> its key, for registered blocks
        self._block_of: dict[bytes, int] = {}  # key -> the registered block
        # Registered blocks nobody holds, least recently released first: evicted in that order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.stats = PrefixStats()

    # --- accounting ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks a request may take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """The fraction of blocks held by sequences (vLLM's kv_cache_usage_perc, as 0..1)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    # --- a sequence's lifecycle ----------------------------------------------------------------

    def admit(self, token_ids: Sequence[int]) -> BlockTable:
        """A table for a sequence whose context is `token_ids`, holding the longest prefix of
        its full blocks that the cache has (their references taken). At least the last token
        is left to compute: its logits are the next token's."""
        table = BlockTable()
        if not self.enable_caching:
            return table
        usable = (len(token_ids) - 1) // self.block_size  # full blocks before the last token
        key = self._salt
        for index in range(usable):
            key = self._key(key, token_ids[index * self.block_size:(index + 1) * self.block_size])
            block = self._block_of.get(key)
            if block is None:
                break
            self._hold(block)
            table.blocks.append(block)
            table.hashes.append(key)
        table.num_cached = len(table.blocks) * self.block_size
        return table

    def record_lookup(self, num_tokens: int, num_hits: int) -> None:
        """Counts an admitted sequence's prefix lookup (a refused admission counts nothing)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hits

    def can_ensure(self, table: BlockTable, num_positions: int) -> bool:
        return self.blocks_for(num_positions) - len(table.blocks) <= self.num_free

    def ensure(self, table: BlockTable, num_positions: int) -> bool:
        """Grows the table to hold `num_positions` positions; False, taking nothing, when the
        cache has too few blocks left."""
        needed = self.blocks_for(num_positions) - len(table.blocks)
        if needed <= 0:
            return True
        if needed > self.num_free:
            return False
        for _ in range(needed):
            table.blocks.append(self._take_fresh())
        return True

    def register_full(self, table: BlockTable, num_final: int,
                      tokens_from: Callable[[int], Sequence[int]]) -> None:
        """Registers the table's blocks that are now full of final keys and values (the first
        `num_final` positions are) under their keys; `tokens_from(p)`: the sequence's tokens
        from position p on (only the ones not yet registered are asked for)."""
        if not self.enable_caching:
            return
        full = min(num_final // self.block_size, len(table.blocks))
        first = len(table.hashes)
        if full <= first:
            return
        token_ids = tokens_from(first * self.block_size)
        for index in range(first, full):
            parent = table.hashes[-1] if table.hashes else self._salt
            start = (index - first) * self.block_size
            key = self._key(parent, token_ids[start:start + self.block_size])
            table.hashes.append(key)
            block = table.blocks[index]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key

    def release(self, table: BlockTable) -> None:
        """Drops the sequence's hold on its blocks (it finished, or is preempted): registered
        ones stay cached until evicted, the rest are free again."""
        for block in table.blocks:
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._key_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)
        table.blocks.clear()
        table.hashes.clear()
        table.num_cached = 0

    # --- blocks ------------------------------------------------------------------------------

    def _key(self, parent: bytes, token_ids: Sequence[int]) -> bytes:
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))
        return digest.digest()

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take_fresh(self) -> int:
        """A block for new keys and values: a free one, else the least recently released cached
        one (its key forgotten)."""
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        self._refs[block] = 1
        return block
