"""Runs the target model over context chunks (prefill) and over batches of draft trees
(verification), on the paged KV cache.

A step's rows name their place in the cache (`CacheRow`: their blocks, the positions already
computed); the engine's block manager hands out the blocks. A chunk of context is verified as
what it is, a chain: in rows of at most MAX_TREE_BITS_NODES tokens, each attending to the
row's cached positions and to its own tokens before it, through the same attention as a draft
tree's nodes. So a position's keys and values are the same bits whether it was prefilled whole,
in chunks, or decoded a step at a time inside draft trees: the KV cache is a pure function of
the token prefix, which makes prefix caching exact.

Two implementations of the forward pass (EngineConfig.model_impl):
- sssd: the project's own (sssd.common.model.decoder), for the Llama and Qwen2 families;
- transformers: the transformers model's forward over the same KV cache, for every other
  architecture and as the reference the tests hold the first one to.

For tests and profiling the runner also keeps `slots`: fixed block tables of its own, with the
slot-numbered `prefill`, `verify` and `commit` of a runner that holds a few sequences (never
used beside a block manager's tables).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.model import kernel_paths
from sssd.common.model.decoder import Segment, decoder_for
from sssd.common.model.kv_cache import cache_keyword
from sssd.common.model.paged_kv_cache import PagedKVCache
from sssd.common.model.tree_batch import (
    KV_ALIGN,
    MAX_TREE_BITS_NODES,
    TreeBatch,
    build_tree_batch,
    chain_tree,
)
from sssd.verifier.engine.handoff import PrefilledPrompt

logger = logging.getLogger(__name__)

# Nodes per tree of the fixed verification shape on CUDA (ModelRunner's fixed_nodes), unless
# the engine names its largest budget.
DEFAULT_FIXED_NODES = 32
DEFAULT_BLOCK_SIZE = 16  # positions a cache block holds: the kernels read keys 16 at a time
# A prefill worker's prompt runs in passes of this many tokens: a pass's activations grow with
# its tokens (an MLP's are intermediate_size wide), its time hardly at all past a few hundred.
HANDOFF_CHUNK = 2048


@dataclass(frozen=True)
class CacheRow:
    """A sequence's place in the paged cache for one step: its blocks in position order, and
    how many leading positions are already computed (the step's tokens follow them)."""

    blocks: Sequence[int]
    num_cached: int

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


@dataclass(frozen=True)
class Chunk:
    """A run of a sequence's context prefilled in one step, written after `row.num_cached`;
    `wants_logits`: it ends the context, so its last token's logits give the next token."""

    row: CacheRow
    token_ids: Sequence[int]
    wants_logits: bool = True


class ModelRunner:
    """Owns the KV cache and runs every forward pass over it."""

    def __init__(self, model: torch.nn.Module, max_seqs: int, max_len: int,
                 attention: str = "sdpa", model_impl: str = "auto",
                 fixed_nodes: int | None = None, num_blocks: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        """`max_len`: the most positions a sequence reaches (its context window).
        `num_blocks`: the cache's blocks of `block_size` positions (default: enough for
        `max_seqs` sequences of `max_len`, each in a slot of its own).
        `attention`: the transformers forward's attention kernel (EngineConfig.attention). It
        is a setting of the model object, so runners that share one loaded model share it too.
        `model_impl`: which forward pass (sssd.common.model.impls, see decoder_for).

        `fixed_nodes`: run every verification pass of up to that many nodes per tree at one
        shape, [max_seqs, fixed_nodes] tokens (padding nodes attend only to themselves; padding
        rows to nothing), through the verifier's own PyTorch forward. The default: on CUDA,
        DEFAULT_FIXED_NODES; on the CPU, none (the CPU kernels compute a row the same way
        whatever the rows beside it). On a GPU the libraries choose a product's algorithm, and
        with it the order of its sums, by the shape: in bfloat16, a tree verified at another
        shape than plain decoding's rounds differently, and greedy speculation then leaves plain
        decoding's tokens. At one shape a row's products and norms are computed the same way in
        plain decoding and in any tree, and each node attends over its own keys in text order
        (torch_ops.path_attention); what has been checked on a GPU is in
        docs/services/verifier.md."""
        config = model.config
        self.model = model
        self._cache_keyword = cache_keyword(model)
        self.decoder = decoder_for(model, model_impl)
        if getattr(config, "_attn_implementation", None) != attention:
            model.set_attn_implementation(attention)
        weight = next(model.parameters())
        # The model's device is the runner's: the cache and every step's tensors go there.
        self.dtype, self.device = weight.dtype, weight.device
        if fixed_nodes is None and self.device.type == "cuda":
            fixed_nodes = DEFAULT_FIXED_NODES
        if fixed_nodes is not None and not 1 <= fixed_nodes <= MAX_TREE_BITS_NODES:
            raise ValueError(f"fixed_nodes must be in [1, {MAX_TREE_BITS_NODES}], got "
                             f"{fixed_nodes}")
        self.fixed_nodes = fixed_nodes if self.decoder is not None else None
        self.max_len = max_len
        self.max_seqs = max_seqs
        self.block_size = block_size
        # padding nodes are written past a row's last position: room for them at the end
        self.positions_per_row = max_len + max(self.fixed_nodes or 0, MAX_TREE_BITS_NODES)
        self.blocks_per_slot = -(-self.positions_per_row // block_size)
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.cache = PagedKVCache(
            num_layers=config.num_hidden_layers,
            num_blocks=num_blocks or max(1, max_seqs) * self.blocks_per_slot,
            block_size=block_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            dtype=self.dtype,
            device=self.device,
            max_positions=self.positions_per_row,
        )
        self._warned_shape = False
        # 1 reproduces the unaligned key length (bench/batch_invariance.py)
        self.kv_align = KV_ALIGN
        self.vocab_size = model.get_output_embeddings().weight.shape[0]  # width of the logits
        self.slot_lengths = [0] * max_seqs  # the slots' computed positions

    # --- a step over cache rows (the engine's) --------------------------------------------------

    @torch.inference_mode()
    def forward(self, trees: Sequence[tuple[CacheRow, DraftTree]], chunks: Sequence[Chunk],
                ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """One forward pass that verifies the trees (call `commit` afterwards) and prefills the
        chunks. The verifier's own forward pass runs them together, so a step that prefills
        reads the weights once; each row's logits are those it gets in a pass of its own.
        Returns the verification logits [num_trees, max_nodes, vocab_size] in the model's
        dtype (None without trees; row i's first trees[i].num_nodes positions are real) and,
        per chunk, its last token's logits [vocab_size] float32 (None unless wanted)."""
        for chunk in chunks:
            end = chunk.row.num_cached + len(chunk.token_ids)
            if not chunk.token_ids or end > self.max_len:
                raise ValueError(f"a chunk of {len(chunk.token_ids)} tokens after "
                                 f"{chunk.row.num_cached} does not fit {self.max_len} positions")
        segments = [self._verification(trees)] if trees else []
        if chunks:
            segments.append(self._prefill_segment(chunks))
        if self.decoder is not None:
            outputs = self.decoder.forward_segments(segments, self.cache)
        else:
            outputs = [self._forward_transformers(s) for s in segments]
        verified = None
        if trees:  # [num_seqs, max_nodes, vocab_size], less any padding nodes of the fixed shape
            verified = outputs.pop(0)[:, :max(tree.num_nodes for _, tree in trees)]
        chunk_logits: list[torch.Tensor | None] = []
        if chunks:
            wanted = iter(outputs[0])  # [num_wanted, vocab_size]
            chunk_logits = [next(wanted).float() if chunk.wants_logits else None
                            for chunk in chunks]
        return verified, chunk_logits

    def commit(self, rows: Sequence[CacheRow], accepted_nodes: Sequence[Sequence[int]]) -> None:
        """Keeps each row's root and accepted path (node indices, root excluded) in the cache:
        node k of the path goes to position num_cached + depth."""
        sources, targets = [], []
        for row, nodes in zip(rows, accepted_nodes):
            for depth, node in enumerate(nodes, start=1):
                if node != depth:  # already in place when the path is a prefix of the layout
                    sources.append(self._slot(row, row.num_cached + node))
                    targets.append(self._slot(row, row.num_cached + depth))
        self.cache.move(sources, targets)

    def _slot(self, row: CacheRow, position: int) -> int:
        """A row's position as a position of the whole cache (block * block_size + offset)."""
        index = position // self.block_size
        if index >= len(row.blocks):
            raise IndexError(f"position {position} lies past the row's {len(row.blocks)} blocks")
        return row.blocks[index] * self.block_size + position % self.block_size

    def _verification(self, trees: Sequence[tuple[CacheRow, DraftTree]]) -> Segment:
        """The segment of a verification pass: at the fixed shape when there is one and the
        trees fit it."""
        nodes = self.fixed_nodes
        if nodes is None or self.decoder.fused:  # the fused kernels: shape-independent
            return Segment(self._batch(trees), 0)
        if max(tree.num_nodes for _, tree in trees) > nodes:
            if not self._warned_shape:
                self._warned_shape = True
                logger.warning("a draft tree of more than %d nodes: verified at its own shape, "
                               "where bfloat16 may round differently from plain decoding "
                               "(raise fixed_nodes to the largest budget)", nodes)
            return Segment(self._batch(trees), 0)
        return Segment(self._batch(trees, nodes), 0, num_rows=max(1, self.max_seqs) * nodes,
                       by_path=True)

    def _prefill_segment(self, chunks: Sequence[Chunk]) -> Segment:
        """Every chunk as chains of at most MAX_TREE_BITS_NODES tokens, one row each, and the
        tokens whose logits are wanted (each wanting chunk's last)."""
        rows, logit_tokens = [], []
        width = min(MAX_TREE_BITS_NODES, max(len(chunk.token_ids) for chunk in chunks))
        for chunk in chunks:
            ids = list(chunk.token_ids)
            for start in range(0, len(ids), width):
                piece = ids[start:start + width]
                rows.append((CacheRow(chunk.row.blocks, chunk.row.num_cached + start),
                             chain_tree(piece)))
            if chunk.wants_logits:
                logit_tokens.append((len(rows) - 1) * width + len(piece) - 1)
        return Segment(self._batch(rows, width), 0, logit_tokens=tuple(logit_tokens))

    def _batch(self, rows: Sequence[tuple[CacheRow, DraftTree]], min_nodes: int = 1,
               ) -> TreeBatch:
        return build_tree_batch([tree for _, tree in rows], [row.num_cached for row, _ in rows],
                                self.dtype, self.kv_align, self.device, min_nodes,
                                [row.blocks for row, _ in rows], self.block_size)

    def _forward_transformers(self, segment: Segment) -> torch.Tensor:
        batch = segment.batch
        self.cache.begin_segment(segment)
        output = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            use_cache=True,
            **{self._cache_keyword: self.cache},
        )
        logits = output.logits  # [num_seqs, num_nodes, vocab_size]
        if segment.logit_tokens is None:
            return logits
        return logits.reshape(-1, logits.shape[-1])[list(segment.logit_tokens)]

    # --- the prefill/decode handoff --------------------------------------------------------------

    @torch.inference_mode()
    def prefill_for_handoff(self, token_ids: Sequence[int], blocks: Sequence[int] | None = None,
                            num_cached: int = 0) -> PrefilledPrompt:
        """Prefills into `blocks` (default: slot 0's), of which the first `num_cached`
        positions already hold the prompt's keys and values (a prefix cache's), in chunks of
        HANDOFF_CHUNK tokens, and returns a copy of the whole prompt's KV cache and its
        next-token logits, for a decode worker elsewhere (`load_prefilled`); on a GPU the keys,
        the values and the logits each leave it once."""
        start = time.perf_counter()
        if blocks is None:
            blocks = self.slot_row(0).blocks
        if not 0 <= num_cached < len(token_ids):
            raise ValueError(f"{num_cached} cached positions of a {len(token_ids)}-token prompt "
                             "leave nothing to compute")
        logits = None
        for first in range(num_cached, len(token_ids), HANDOFF_CHUNK):
            piece = token_ids[first:first + HANDOFF_CHUNK]
            is_last = first + len(piece) == len(token_ids)
            _, (logits,) = self.forward([], [Chunk(CacheRow(blocks, first), piece, is_last)])
        keys, values = self.cache.export(blocks, len(token_ids))
        return PrefilledPrompt.from_tensors(keys, values, logits, time.perf_counter() - start,
                                            num_cached)

    def check_prefilled(self, prefilled: PrefilledPrompt) -> None:
        """Raises ValueError unless the prefilled KV was made by a model shaped like this one."""
        layers, heads, length, head_dim = prefilled.keys.shape
        expected = (len(self.cache.keys), self.cache.num_kv_heads, self.cache.head_dim,
                    self.vocab_size, str(self.dtype).removeprefix("torch."))
        got = (layers, heads, head_dim, prefilled.logits.shape[0], prefilled.dtype)
        if got != expected or prefilled.values.shape != prefilled.keys.shape:
            raise ValueError(f"prefilled KV (layers, kv heads, head dim, vocab, dtype) = {got} "
                             f"does not match this model's {expected}")
        if length + 1 >= self.max_len:
            raise ValueError(f"prefilled prompt of {length} tokens does not fit the context "
                             f"window of {self.max_len}")

    def load_prefilled(self, blocks: Sequence[int], prefilled: PrefilledPrompt) -> torch.Tensor:
        """Takes over a prompt prefilled elsewhere into `blocks`; returns its logits
        [vocab_size]."""
        self.check_prefilled(prefilled)
        keys, values, logits = prefilled.tensors()
        # One copy each to this runner's device; the cache then scatters them into the blocks.
        self.cache.load(blocks, keys.to(self.device), values.to(self.device))
        return logits

    # --- what runs ---------------------------------------------------------------------------

    @property
    def prefix_salt(self) -> bytes:
        """What a prefix cache's block keys hold beside the tokens: the model and the numbers
        its keys and values are (blocks of another model or dtype are never the same)."""
        config = self.model.config
        return (f"{getattr(config, '_name_or_path', '')}|{config.model_type}|{self.dtype}|"
                f"{self.vocab_size}").encode()

    @property
    def impl(self) -> str:
        """The forward pass in use: "sssd" or "transformers"."""
        return "transformers" if self.decoder is None else "sssd"

    @property
    def attention_path(self) -> str:
        """What attends: the path of sssd._kernels' tree attention (kernel_paths) under the own
        fused forward pass, else "torch"."""
        if self.decoder is None or not self.decoder.fused:
            return "torch"
        return kernel_paths.path("tree_attention", self.dtype)

    @property
    def products(self) -> str:
        """Who runs the own forward pass's matrix products (Decoder.layout: amx, panels,
        onednn, plain), or "transformers"."""
        return "transformers" if self.decoder is None else self.decoder.layout

    # --- slots: fixed block tables of the runner's own (tests, profiling) --------------------

    def slot_row(self, slot: int) -> CacheRow:
        """Slot `slot`'s row: contiguous blocks of its own, a window's worth where the cache
        holds that many for every slot."""
        if not 0 <= slot < self.max_seqs:
            raise ValueError(f"slot {slot} outside the runner's {self.max_seqs}")
        per_slot = min(self.blocks_per_slot, self.cache.num_blocks // self.max_seqs)
        first = slot * per_slot
        return CacheRow(range(first, first + per_slot), self.slot_lengths[slot])

    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Writes a prompt's KV into `slot` from position 0; returns the logits after it:
        [vocab_size] float32."""
        return self.verify_and_prefill([], [(slot, token_ids)])[1][0]

    def verify(self, trees: Sequence[DraftTree]) -> torch.Tensor:
        """One forward pass over the trees of slots [0, len(trees)); call `commit_slots`."""
        return self.verify_and_prefill(trees, [])[0]

    def verify_and_prefill(self, trees: Sequence[DraftTree],
                           prompts: Sequence[tuple[int, Sequence[int]]],
                           ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """`forward` over slots: trees of slots [0, len(trees)), each (slot, prompt) written
        from position 0 of its slot."""
        for slot, _ in prompts:
            if slot < len(trees):
                raise ValueError(f"slot {slot} holds a verified row of the same pass")
            self.slot_lengths[slot] = 0
        rows = [(self.slot_row(slot), tree) for slot, tree in enumerate(trees)]
        chunks = [Chunk(self.slot_row(slot), ids) for slot, ids in prompts]
        verified, logits = self.forward(rows, chunks)
        for slot, ids in prompts:
            self.slot_lengths[slot] = len(ids)
        return verified, logits

    def room(self, slot: int) -> int:
        """Positions still free in `slot`."""
        return self.slot_row(slot).capacity(self.block_size) - self.slot_lengths[slot]

    def commit_slots(self, accepted_nodes: Sequence[Sequence[int]]) -> None:
        """`commit` for slots [0, len(accepted_nodes)), their lengths advanced."""
        rows = [self.slot_row(slot) for slot in range(len(accepted_nodes))]
        self.commit(rows, accepted_nodes)
        for slot, nodes in enumerate(accepted_nodes):
            self.slot_lengths[slot] += 1 + len(nodes)
