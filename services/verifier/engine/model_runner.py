"""Runs the target model over prompts (prefill) and over batches of draft trees (verification).

Two implementations of the forward pass (EngineConfig.model_impl):
- sssd: the project's own (sssd.common.model.decoder), for the Llama and Qwen2 families;
- transformers: the transformers model's forward over the same KV cache, for every other
  architecture and as the reference the tests hold the first one to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from sssd.common.drafting.draft_tree import DraftTree
from sssd.common.model import kernel_paths
from sssd.common.model.decoder import Segment, decoder_for
from sssd.common.model.kv_cache import SlotKVCache, cache_keyword
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


class ModelRunner:
    """Owns the KV cache; the batch of running sequences occupies slots [0, num_running)."""

    def __init__(self, model: torch.nn.Module, max_seqs: int, max_len: int,
                 attention: str = "sdpa", model_impl: str = "auto",
                 fixed_nodes: int | None = None) -> None:
        """`attention`: the transformers forward's attention kernel (EngineConfig.attention). It
        is a setting of the model object, so runners that share one loaded model share it too.
        `model_impl`: which forward pass (sssd.common.model.impls, see decoder_for).

        `fixed_nodes`: run every verification pass of up to that many nodes per tree at one
        shape, [max_seqs, fixed_nodes] tokens (padding nodes attend only to themselves; padding
        rows to nothing), through the verifier's own PyTorch forward. The default: on CUDA,
        DEFAULT_FIXED_NODES; on the CPU, none (the CPU kernels compute a row the same way
        whatever the rows beside it). On a GPU the libraries choose a product's algorithm, and
        with it the order of its sums, by the shape: in bfloat16, a tree verified at another
        shape than plain decoding's rounds differently, and greedy speculation then leaves plain
        decoding's tokens (12 of 16 MT-Bench answers on an H100 without it). At one shape a
        row's products and norms are computed the same way in plain decoding and in any tree,
        and each node attends over its own keys in text order (decoder.path_attention); what
        has been checked on a GPU is in docs/services/verifier.md. A GPU step of a small batch
        costs the weights' reading either way."""
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
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.cache = SlotKVCache(
            num_layers=config.num_hidden_layers,
            max_seqs=max_seqs,
            num_kv_heads=config.num_key_value_heads,
            # padding nodes are written past a row's last position: room for them at the end
            max_len=max_len + (self.fixed_nodes or 0),
            head_dim=head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.max_len = max_len
        self._warned_shape = False
        # 1 reproduces the unaligned key length (bench/batch_invariance.py)
        self.kv_align = KV_ALIGN
        self.vocab_size = model.get_output_embeddings().weight.shape[0]  # width of the logits

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Writes the prompt's KV into `slot`; returns the logits after it: [vocab_size] float32."""
        return self.verify_and_prefill([], [(slot, token_ids)])[1][0]

    @torch.inference_mode()
    def verify_and_prefill(
        self, trees: Sequence[DraftTree], prompts: Sequence[tuple[int, Sequence[int]]],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """One forward pass that verifies the trees of slots [0, len(trees)) (as `verify`; call
        `commit` afterwards) and prefills each (slot, prompt) of `prompts` into its slot, past
        the verified ones. The verifier's own forward pass runs them together, so a decode step
        that admits a request reads the weights once; each row's logits are those it gets in a
        pass of its own. Returns the verification logits (None without trees) and each prompt's
        next-token logits [vocab_size] float32."""
        for slot, token_ids in prompts:
            if len(token_ids) + 1 > self.max_len:
                raise ValueError(f"prompt of {len(token_ids)} tokens does not fit the cache "
                                 f"({self.max_len} positions)")
            if slot < len(trees):
                raise ValueError(f"slot {slot} holds a verified row of the same pass")
            self.cache.set_length(slot, 0)
        segments = [self._verification(trees)] if trees else []
        segments += [Segment(self._batch([chain_tree(token_ids)], slot), slot, logits_to_keep=1)
                     for slot, token_ids in prompts]
        if self.decoder is not None:
            outputs = self.decoder.forward_segments(segments, self.cache)
        else:
            outputs = [self._forward_transformers(s.batch, s.first_slot, s.logits_to_keep)
                       for s in segments]
        for slot, token_ids in prompts:
            self.cache.set_length(slot, len(token_ids))
        # [num_seqs, max_nodes, vocab_size], less any padding nodes of the fixed shape
        verified = outputs.pop(0)[:, :max(t.num_nodes for t in trees)] if trees else None
        return verified, [logits[0, -1].float() for logits in outputs]

    @torch.inference_mode()
    def prefill_for_handoff(self, token_ids: Sequence[int], slot: int = 0) -> PrefilledPrompt:
        """Prefills in `slot` and returns a copy of the prompt's KV cache and its next-token
        logits, for a decode worker elsewhere (`load_prefilled`); on a GPU the keys, the values
        and the logits each leave it once."""
        start = time.perf_counter()
        logits = self.prefill(slot, token_ids)
        keys, values = self.cache.export(slot)
        return PrefilledPrompt.from_tensors(keys, values, logits, time.perf_counter() - start)

    def check_prefilled(self, prefilled: PrefilledPrompt) -> None:
        """Raises ValueError unless the prefilled KV was made by a model shaped like this one."""
        cache = self.cache.keys[0]  # [max_seqs, num_kv_heads, max_len, head_dim]
        layers, heads, length, head_dim = prefilled.keys.shape
        expected = (len(self.cache.keys), cache.shape[1], cache.shape[3], self.vocab_size,
                    str(self.dtype).removeprefix("torch."))
        got = (layers, heads, head_dim, prefilled.logits.shape[0], prefilled.dtype)
        if got != expected or prefilled.values.shape != prefilled.keys.shape:
            raise ValueError(f"prefilled KV (layers, kv heads, head dim, vocab, dtype) = {got} "
                             f"does not match this model's {expected}")
        if length + 1 >= self.max_len:
            raise ValueError(f"prefilled prompt of {length} tokens does not fit the cache")

    def load_prefilled(self, slot: int, prefilled: PrefilledPrompt) -> torch.Tensor:
        """Takes over a prompt prefilled elsewhere into `slot`; returns its logits [vocab_size]."""
        self.check_prefilled(prefilled)
        keys, values, logits = prefilled.tensors()
        # One copy each to this runner's device; the cache then copies layer by layer on it.
        self.cache.load(slot, keys.to(self.device), values.to(self.device))
        return logits

    @property
    def impl(self) -> str:
        """The forward pass in use: "sssd" or "transformers"."""
        return "transformers" if self.decoder is None else "sssd"

    @property
    def prompt_kernel(self) -> str:
        """Where a prompt's attention runs: the path of sssd._kernels' prompt attention
        (kernel_paths) under the own fused forward pass, else "torch"."""
        if self.decoder is None or not self.decoder.fused or \
                self.decoder.head_dim not in (64, 128):
            return "torch"
        path = kernel_paths.path("prompt_attention", self.dtype)
        return "torch" if path == "none" else path

    @property
    def products(self) -> str:
        """Who runs the own forward pass's matrix products (Decoder.layout: amx, panels,
        onednn, plain), or "transformers"."""
        return "transformers" if self.decoder is None else self.decoder.layout

    @torch.inference_mode()
    def verify(self, trees: Sequence[DraftTree]) -> torch.Tensor:
        """One forward pass over the trees of slots [0, len(trees)).

        Returns logits [num_seqs, max_nodes, vocab_size] in the model's dtype (argmax as in
        float32; sampling converts the rows it needs); row i's first trees[i].num_nodes
        positions are real. Call `commit` afterwards.
        """
        return self.verify_and_prefill(trees, [])[0]

    def _batch(self, trees: Sequence[DraftTree], first_slot: int,
               min_nodes: int = 1) -> TreeBatch:
        cache_lens = [self.cache.lengths[first_slot + row] for row in range(len(trees))]
        return build_tree_batch(trees, cache_lens, self.dtype, self.kv_align, self.device,
                                min_nodes)

    def _verification(self, trees: Sequence[DraftTree]) -> Segment:
        """The segment of a verification pass over slots [0, len(trees)): at the fixed shape
        when there is one and the trees fit it."""
        nodes = self.fixed_nodes
        if nodes is None or self.decoder.fused:  # the fused kernels: shape-independent
            return Segment(self._batch(trees, 0), 0)
        if max(tree.num_nodes for tree in trees) > nodes:
            if not self._warned_shape:
                self._warned_shape = True
                logger.warning("a draft tree of more than %d nodes: verified at its own shape, "
                               "where bfloat16 may round differently from plain decoding "
                               "(raise fixed_nodes to the largest budget)", nodes)
            return Segment(self._batch(trees, 0), 0)
        return Segment(self._batch(trees, 0, nodes), 0, num_rows=self.max_seqs * nodes,
                       by_path=True)

    def _forward_transformers(self, batch: TreeBatch, first_slot: int,
                              logits_to_keep: int = 0) -> torch.Tensor:
        self.cache.begin_step(first_slot, len(batch.trees), batch.write_positions, batch.kv_len)
        output = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=batch.attention_mask,
            use_cache=True,
            **{self._cache_keyword: self.cache},
            logits_to_keep=logits_to_keep,
        )
        return output.logits

    def commit(self, accepted_nodes: Sequence[Sequence[int]]) -> None:
        """Keeps row i's root and accepted path (node indices, root excluded) in the cache."""
        self.cache.commit(range(len(accepted_nodes)), accepted_nodes)

    @property
    def max_seqs(self) -> int:
        """KV-cache slots: the most sequences a step can hold."""
        return self.cache.max_seqs

    def move_slot(self, source: int, target: int) -> None:
        """Moves a sequence's cache to another slot (compaction after a sequence leaves)."""
        self.cache.move(source, target)

    def room(self, slot: int) -> int:
        """Cache positions still free in `slot`."""
        return self.max_len - self.cache.lengths[slot]
