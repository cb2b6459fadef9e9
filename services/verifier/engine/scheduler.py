"""Which sequences wait and which run, and what each running one computes in the next step.

Running sequences are in admission order (the youngest last). A sequence is admitted while the
batch has room (`max_batch_size`) and the KV cache has blocks for its first chunk; on admission
the prefix cache gives it the blocks of the longest prefix already computed (block_manager.py).
Its context is then prefilled in chunks under a per-step token budget, interleaved with the
other sequences' decode steps, so a long prompt does not stop everyone else's tokens for the
whole of its prefill. When a step needs blocks the cache no longer has, the youngest running
sequence is preempted: its blocks are released (its full ones stay cached) and it waits at the
front of the queue to be computed again, output so far included. No request fails for want of
blocks.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from sssd.common.model.tree_batch import MAX_TREE_BITS_NODES
from sssd.verifier.engine.block_manager import BlockManager
from sssd.verifier.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# A chunk is run as rows of up to MAX_TREE_BITS_NODES tokens (model_runner.py), its last row
# padded to the others' width: its blocks hold that padding too.
CHUNK_PADDING = MAX_TREE_BITS_NODES - 1


@dataclass(frozen=True)
class ChunkPlan:
    """A prefill chunk of one step: `num_tokens` of the sequence's context from position
    seq.table.num_cached on."""

    seq: Sequence
    num_tokens: int

    @property
    def is_last(self) -> bool:
        """It ends the context: its logits give the sequence's next token."""
        return self.seq.table.num_cached + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, max_batch_size: int, blocks: BlockManager,
                 max_num_batched_tokens: int = 512) -> None:
        if max_batch_size < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_batch_size and max_num_batched_tokens must be >= 1")
        self.max_batch_size = max_batch_size
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the youngest last
        self.num_preemptions = 0  # all time

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def decoding(self) -> list[Sequence]:
        """The running sequences whose context is computed: they verify a tree this step."""
        return [seq for seq in self.running if seq.is_prefilled]

    # --- a step's plan ---------------------------------------------------------------------------

    def schedule(self, budget: int) -> tuple[list[Sequence], list[ChunkPlan]]:
        """This step's work, within the KV cache's blocks: the running sequences in admission
        order (the decoding ones verify a tree of up to `budget` nodes after their cached
        positions; the prefilling ones prefill their next chunk), then newly admitted ones,
        their chunks within max_num_batched_tokens tokens in all. Where a running sequence's
        blocks cannot be had, the youngest running sequence is preempted (it may be that one),
        which never touches one already planned (those are older); a waiting sequence is
        admitted only while blocks remain for its chunk."""
        decoding: list[Sequence] = []
        plans: list[ChunkPlan] = []
        left = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq not in self.running:  # preempted for an older one
                continue
            if not seq.is_prefilled and left == 0:
                continue
            size = budget if seq.is_prefilled else \
                min(left, seq.num_tokens - seq.table.num_cached)
            room = size if seq.is_prefilled else size + CHUNK_PADDING
            while seq in self.running and \
                    not self.blocks.ensure(seq.table, seq.table.num_cached + room):
                self.preempt(self.running[-1])
            if seq not in self.running:
                continue
            if seq.is_prefilled:
                decoding.append(seq)
            else:
                plans.append(ChunkPlan(seq, size))
                left -= size
        plans += self._admit(left)
        return decoding, plans

    def _admit(self, left: int) -> list[ChunkPlan]:
        """Admits waiting sequences, oldest first, while the batch, the token budget `left`
        and the cache's blocks allow; returns their first chunks. A sequence that shares half
        its prompt or more with one that is still prefilling it waits (first in line) until the
        shared blocks are computed, then takes them from the prefix cache: the n choices of one
        prompt, or requests with one long system prompt arriving together, prefill it once."""
        plans = []
        deferred: list[Sequence] = []
        while left > 0 and self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if seq.prefilled is None and self._awaits_shared_blocks(seq):
                deferred.append(self.waiting.popleft())
                continue
            if seq.prefilled is not None:  # computed elsewhere: blocks for all of it, no tokens
                if not self.blocks.ensure(seq.table, seq.num_tokens):
                    break
                self.waiting.popleft()
                self.running.append(seq)
                plans.append(ChunkPlan(seq, seq.num_tokens))
                seq.num_cached_tokens = seq.prefilled.num_cached_tokens
                continue
            seq.table = self.blocks.admit(seq.token_ids_from(0))
            size = min(left, seq.num_tokens - seq.table.num_cached)
            if not self.blocks.ensure(seq.table, seq.table.num_cached + size + CHUNK_PADDING):
                self.blocks.release(seq.table)  # it waits for blocks, first in line
                break
            self.blocks.record_lookup(seq.num_tokens, seq.table.num_cached)
            if seq.num_cached_tokens is None:  # a preempted one's readmission keeps its first
                seq.num_cached_tokens = seq.table.num_cached
            self.waiting.popleft()
            self.running.append(seq)
            plans.append(ChunkPlan(seq, size))
            left -= size
        self.waiting.extendleft(reversed(deferred))
        return plans

    def _awaits_shared_blocks(self, seq: Sequence) -> bool:
        """Whether a running, still prefilling sequence shares at least half of `seq`'s prompt
        in full blocks, some of them not computed yet. Waiting costs `seq` a step or a few; a
        shared half saves it at least half its prefill (a short shared system prompt does not
        hold a request back)."""
        if not self.blocks.enable_caching:
            return False
        size = self.blocks.block_size
        usable = (seq.num_tokens - 1) // size  # the full blocks admit() could take
        half = -(-seq.num_tokens // (2 * size))
        prompt = seq.request.prompt_ids  # what is shared is a prompt's (a choice, a system prompt)
        for other in self.running:
            if other.is_prefilled:
                continue  # its full blocks are registered: admit() finds them
            # shared blocks up to the first one it has not computed, and half the prompt; a
            # block's key names its whole prefix, so one comparison of that prefix decides
            end = max(other.table.num_cached // size + 1, half) * size
            theirs = other.request.prompt_ids
            if end <= min(usable * size, len(prompt), len(theirs)) and \
                    theirs[:end] == prompt[:end]:
                return True
        return False

    def preempt(self, seq: Sequence) -> None:
        """Stops a running sequence and queues it first, to be computed again from its prompt
        and output so far (its full blocks stay in the prefix cache)."""
        self.running.remove(seq)
        self.blocks.release(seq.table)
        seq.is_prefilled = False
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.info("preempted %s (%d tokens) for want of KV blocks", seq.request_id,
                    seq.num_tokens)

    # --- after a step ----------------------------------------------------------------------------

    def retire(self) -> list[Sequence]:
        """Removes finished sequences and releases their blocks; returns them in batch order."""
        finished = [seq for seq in self.running if seq.is_finished]
        for seq in finished:
            self.running.remove(seq)
            self.blocks.release(seq.table)
        return finished

    def abort(self, request_id: str) -> Sequence | None:
        """Ends a waiting or running sequence now ("cancelled"); None when it is not here."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "cancelled"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish_reason = "cancelled"
                self.retire()
                return seq
        return None
