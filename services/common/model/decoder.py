"""The project's own forward pass for decoder-only transformers of the Llama and Qwen2 families
(SmolLM2, Qwen2.5): the transformers model is the weight loader and the exactness reference, and
this is what runs every step of the verifier's target model (verifier/engine/model_runner.py)
and of the speculator's draft model (speculator/runner.py, through `hidden_states`: its steps'
nodes see what a mask allows rather than a tree's ancestors).

A step of a small model on a CPU costs more in dispatch than in arithmetic when it goes through
the transformers modules, and a plain `linear` streams the weights at a fraction of the memory
bandwidth. Here each layer is a handful of operations on weights prepared once:
- query, key and value projections fused into one matrix, gate and up projections into another,
  so a layer makes four matrix products, in the weight layout kernel_paths.products chooses for
  this CPU (linear.py);
- rotary cosines and sines tabulated once for every cache position, by the model's own rotary
  module, so the positions are those of transformers (and every rope scaling it implements);
- attention over the KV cache, each node seeing the cached prefix, its ancestors and itself
  (the tree as a 64-bit mask per node: no mask tensor is built for a step), read through the
  cache's block tables; a prompt's causal attention by a kernel of its own, tiled for the many
  queries that share its keys;
- on CPUs, what runs between the matrix products in one sssd._kernels call each (RMSNorm with
  the residual add, rotary embedding with the cache write, attention, SiLU and product), where
  PyTorch would dispatch a dozen small operations per layer, each costing more than its work;
  elsewhere the same operations in PyTorch (torch_ops.py);
- logits only for the rows asked for.

`Decoder.supports(model)` says whether a model can run here; `decoder_for` falls back to the
transformers forward otherwise, and logs why.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sssd import _kernels
from sssd.common.model import kernel_paths
from sssd.common.model.huge_pages import move_into_huge_pages
from sssd.common.model.impls import MODEL_IMPLS
from sssd.common.model.kernel_paths import DTYPE_CODES
from sssd.common.model.kv_cache import SlotKVCache
from sssd.common.model.linear import MIN_PRODUCT_ROWS, Linear
from sssd.common.model.paged_kv_cache import PagedKVCache
from sssd.common.model.torch_ops import (
    efficient_attention,
    grouped_attention,
    path_attention,
    rms_norm,
    rotate,
)
from sssd.common.model.tree_batch import TreeBatch

FAMILIES = ("llama", "qwen2")
# The verifier's paged cache, or the speculator's slots: both take a segment's writes and give
# its rows' keys (begin_segment, update, segment_tables, segment_kv, capacity, layout).
KVCache = PagedKVCache | SlotKVCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """One step's rows in a forward pass that may hold several: a batch of trees over cache
    slots [first_slot, first_slot + its batch size)."""

    batch: TreeBatch
    first_slot: int  # a slot cache's first row (a paged cache's rows carry their block tables)
    # The tokens whose logits are wanted, as indices into the segment's [num_seqs * num_nodes]
    # tokens (row r's node j: r * num_nodes + j); None: every node's.
    logit_tokens: tuple[int, ...] | None = None
    # The rows every operation of the PyTorch forward runs on (at least the segment's tokens;
    # the rest are padding): a fixed shape makes each row's result independent of the batch
    # where the kernels choose their algorithm by shape (CUDA; see ModelRunner.fixed_nodes).
    num_rows: int = 0
    # Each node attends over its own keys in text order (TreeBatch.path_keys, path_attention):
    # with the fixed shape, a tree's node computes what plain decoding computes for its text.
    by_path: bool = False


@dataclass(frozen=True)
class MaskedNodes:
    """A step whose nodes see what an additive mask allows, where a tree's ancestors do not say
    it: the speculator's, whose branches attend to the chain they grow from and to their own
    earlier nodes, wherever the cache holds them. The caller has called `cache.begin_step`."""

    input_ids: torch.Tensor  # [num_seqs, num_nodes] int64
    position_ids: torch.Tensor  # [num_seqs, num_nodes] int64
    attention_mask: torch.Tensor  # [num_seqs, 1, num_nodes, kv_len] additive, the model's dtype


class UnsupportedModel(ValueError):
    """The model's architecture or one of its options is not implemented here."""


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden_size]
    qkv: Linear  # -> [(num_heads + 2 num_kv_heads) head_dim]
    o: Linear  # -> [hidden_size]
    post_norm: torch.Tensor  # [hidden_size]
    gate_up: Linear  # -> [2 intermediate_size]
    down: Linear  # -> [hidden_size]


def _cat_bias(*modules: torch.nn.Module) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype,
                                                          device=m.weight.device)
                      for b, m in zip(biases, modules)])


class Decoder:
    """The forward pass of a Llama or Qwen2 causal LM over the KV cache."""

    def __init__(self, model: torch.nn.Module, products: str | None = None,
                 fused: bool | None = None) -> None:
        """`model`: a transformers LlamaForCausalLM or Qwen2ForCausalLM (UnsupportedModel
        otherwise); its weights are shared, or copied into the layout of `products` (amx,
        panels, onednn or plain; default: kernel_paths.products, the best this CPU runs).
        `fused`: the layer's small operations by sssd._kernels (default: on the CPU, in float32
        or bfloat16)."""
        self.check(model)
        config, inner = model.config, model.model
        weight = inner.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.intermediate_size = inner.layers[0].mlp.gate_proj.weight.shape[0]
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        widths = (self.hidden_size, self.num_heads * self.head_dim, self.intermediate_size)
        if products is None:
            products = kernel_paths.products(self.dtype, self.device, widths)
        elif products not in kernel_paths.possible_products(self.dtype, self.device, widths):
            raise ValueError(f"products {products!r} cannot run a {self.dtype} model of widths "
                             f"{widths} on this device")
        self.layout = products
        # oneDNN's products run on at least MIN_PRODUCT_ROWS rows (see _layers_fused)
        self.min_rows = MIN_PRODUCT_ROWS if self.layout == "onednn" else 1
        self.rotary = inner.rotary_emb  # transformers' positions, cos and sin, exactly
        self.embed = weight  # [vocab_size, hidden_size]
        self.norm = inner.norm.weight
        self.layers = [self._layer(layer) for layer in inner.layers]
        head = model.get_output_embeddings()
        self.lm_head = Linear(head.weight, head.bias, self.layout)
        self.vocab_size = head.weight.shape[0]
        if self.layout in ("panels", "amx"):  # in the order a step reads them
            move_into_huge_pages([linear for entry in self.layers
                                  for linear in (entry.qkv, entry.o, entry.gate_up, entry.down)]
                                 + [self.lm_head])
        # PyTorch's fused kernel where it is fast and matches transformers' float32 logits to
        # rounding; two matrix products in bfloat16 on the CPU (see grouped_attention).
        self.fused_attention = not (self.device.type == "cpu" and self.dtype == torch.bfloat16)
        self.fused = fused if fused is not None else \
            self.device.type == "cpu" and self.dtype in DTYPE_CODES
        empty = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self._cos, self._sin = empty, empty  # rotary_tables

    def _layer(self, layer: torch.nn.Module) -> _Layer:
        """A transformers decoder layer's weights, fused and in this decoder's layout."""
        attention, mlp = layer.self_attn, layer.mlp
        qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            qkv=Linear(torch.cat([m.weight for m in qkv]), _cat_bias(*qkv), self.layout),
            o=Linear(attention.o_proj.weight, attention.o_proj.bias, self.layout),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                           _cat_bias(mlp.gate_proj, mlp.up_proj), self.layout),
            down=Linear(mlp.down_proj.weight, mlp.down_proj.bias, self.layout))

    @staticmethod
    def check(model: torch.nn.Module) -> None:
        """Raises UnsupportedModel, naming what is not implemented here."""
        config = model.config
        family = getattr(config, "model_type", None)
        if family not in FAMILIES:
            raise UnsupportedModel(f"model type {family!r} (implemented: {', '.join(FAMILIES)})")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"activation {config.hidden_act!r} (implemented: silu)")
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModel("sliding-window attention")
        if getattr(config, "pretraining_tp", 1) != 1:
            raise UnsupportedModel(f"pretraining_tp {config.pretraining_tp}")
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        rope_type = getattr(rotary, "rope_type", "default")
        if rotary is None or "dynamic" in rope_type:
            raise UnsupportedModel(f"rope type {rope_type!r} (its frequencies change with length)")

    @staticmethod
    def supports(model: torch.nn.Module) -> str | None:
        """None when the model runs here, else why not."""
        try:
            Decoder.check(model)
        except UnsupportedModel as exc:
            return str(exc)
        return None

    def forward_segments(self, segments: Sequence[Segment],
                         cache: KVCache) -> list[torch.Tensor]:
        """One forward pass over the segments (verification rows and prefill chunks together):
        writes every node's keys and values at its segment's write positions and returns each
        segment's logits in the model's dtype: [num_seqs, num_nodes, vocab_size], or
        [len(logit_tokens), vocab_size] for a segment that names them. Each segment gets the
        logits a pass of its own would give, to the bit, since a row's products and attention
        do not depend on the rows beside it (see _layers_fused); the matrix products read the
        weights once for all of them."""
        if not self.fused:  # the PyTorch operations take one step at a time
            return [self._forward_unfused(segment, cache) for segment in segments]
        x = self._layers_fused(segments, cache)
        kept, offset = [], 0  # the rows that need logits, from every segment
        for segment in segments:
            num_tokens = segment.batch.input_ids.numel()
            kept.append(_wanted(x[offset:offset + num_tokens], segment))
            offset += num_tokens
        x = kept[0] if len(kept) == 1 else torch.cat(kept)
        logits = self.head(x)
        outputs, offset = [], 0
        for segment, rows in zip(segments, kept):
            wanted = logits[offset:offset + rows.shape[0]]
            if segment.logit_tokens is None:
                wanted = wanted.view(segment.batch.input_ids.shape[0], -1, self.vocab_size)
            outputs.append(wanted)
            offset += rows.shape[0]
        return outputs

    def _forward_unfused(self, segment: Segment, cache: KVCache) -> torch.Tensor:
        batch = segment.batch
        num_seqs, num_nodes = batch.input_ids.shape
        cache.begin_segment(segment)
        num_tokens = num_seqs * num_nodes
        x = self._layers(batch, cache, max(segment.num_rows, num_tokens),  # [rows, hidden]
                         segment.by_path)
        if segment.logit_tokens is not None:
            x = _wanted(x[:num_tokens], segment)
        logits = self.head(rms_norm(x, self.norm, self.eps))  # padding rows too: one shape
        if segment.logit_tokens is not None:
            return logits
        return logits[:num_tokens].view(num_seqs, num_nodes, self.vocab_size)

    def hidden_states(self, nodes: MaskedNodes, cache: KVCache) -> torch.Tensor:
        """The final norm of the hidden states [num_seqs, num_nodes, hidden_size] of a step of
        masked nodes, by the PyTorch operations with this decoder's products (its keys and
        values written where `cache.begin_step` put them); `head` gives the logits of the rows
        that need them."""
        num_seqs, num_nodes = nodes.input_ids.shape
        num_tokens = num_seqs * num_nodes
        x = self._layers(nodes, cache, max(num_tokens, self.min_rows))[:num_tokens]
        return rms_norm(x, self.norm, self.eps).view(num_seqs, num_nodes, -1)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The output head over normed rows x [num_rows, hidden_size]: [num_rows, vocab]."""
        num_rows = x.shape[0]
        if num_rows == 0:  # a segment (a prompt chunk) that needs no logits
            return x.new_empty(0, self.vocab_size)
        if num_rows < self.min_rows:
            x = torch.cat([x, x[-1:].expand(self.min_rows - num_rows, -1)])
        return self.lm_head(x)[:num_rows]

    def rotary_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, head_dim] in the model's dtype, by the model's own rotary module
        (every product of its outer product is one multiplication: the same values as it gives
        step by step); grown to the cache's capacity on first use."""
        if self._cos.shape[0] < length:
            positions = torch.arange(length, device=self.device).unsqueeze(0)
            probe = torch.empty(1, 1, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, positions)  # [1, length, head_dim]
            self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()
        return self._cos, self._sin

    def _layers(self, batch: TreeBatch | MaskedNodes, cache: KVCache, num_rows: int,
                by_path: bool = False) -> torch.Tensor:
        """Every layer as PyTorch operations, the products and norms on `num_rows` rows (the
        batch's tokens, then padding that repeats the last token and attends to nothing), the
        attention per node over its keys in text order when `by_path` (path_attention);
        returns the hidden states [num_rows, hidden]."""
        num_seqs, num_nodes = batch.input_ids.shape
        num_tokens = num_seqs * num_nodes
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos_table, sin_table = self.rotary_tables(cache.capacity)
        # [num_seqs, 1, num_nodes, head_dim]: broadcast over heads
        cos = cos_table[batch.position_ids].unsqueeze(1)
        sin = sin_table[batch.position_ids].unsqueeze(1)
        if by_path:  # once per step: each node's key positions, its mask per query row
            positions, path_mask = batch.path_keys()
            group = num_heads // num_kv_heads
            path_mask = path_mask.expand(-1, 1, group, -1).contiguous()
        else:
            mask = batch.attention_mask
        ids = batch.input_ids.reshape(-1)
        if num_rows > num_tokens:
            ids = torch.cat([ids, ids[-1:].expand(num_rows - num_tokens)])
        x = F.embedding(ids, self.embed)  # [num_rows, hidden_size]
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        padding = x.new_zeros(num_rows - num_tokens, q_width) if num_rows > num_tokens else None
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(rms_norm(x, layer.input_norm, self.eps))  # [num_rows, ...]
            q, k, v = qkv[:num_tokens].split((q_width, kv_width, kv_width), dim=-1)
            # [num_seqs, heads, num_nodes, head_dim]
            q = rotate(q.view(num_seqs, num_nodes, num_heads, head_dim).transpose(1, 2), cos,
                       sin)
            k = rotate(k.view(num_seqs, num_nodes, num_kv_heads, head_dim).transpose(1, 2),
                       cos, sin)
            v = v.view(num_seqs, num_nodes, num_kv_heads, head_dim).transpose(1, 2)
            keys, values = cache.update(k, v, index)  # [num_seqs, kv_heads, kv_len, head_dim]
            if by_path:  # [num_seqs, heads, num_nodes, head_dim]
                attended = path_attention(q, keys, values, positions, path_mask, self.scale)
            elif self.device.type == "cuda":
                attended = efficient_attention(q, keys, values, mask, self.scale)
            elif self.fused_attention:
                attended = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=mask, scale=self.scale,
                    enable_gqa=num_kv_heads != num_heads)
            else:
                attended = grouped_attention(q, keys, values, mask, self.scale)
            attended = attended.transpose(1, 2).reshape(num_tokens, q_width)
            if padding is not None:
                attended = torch.cat([attended, padding])
            x = x + layer.o(attended)
            gate, up = layer.gate_up(rms_norm(x, layer.post_norm, self.eps)).split(
                self.intermediate_size, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return x

    def _layers_fused(self, segments: Sequence[Segment], cache: KVCache) -> torch.Tensor:
        """Every layer with sssd._kernels between the matrix products, the segments' tokens
        one after another as the rows of every product; returns the final norm of the hidden
        states [max(num_tokens, self.min_rows), hidden_size] (the first num_tokens rows are
        the segments', in order).

        The panels compute a row of a product the same way whatever the rows beside it. oneDNN
        does too from two rows up; a single row goes through a matrix-vector kernel that rounds
        differently. So with oneDNN a step of fewer than MIN_PRODUCT_ROWS tokens runs its
        products on that many rows (its last token repeated: the weights are read once either
        way). Either way, with the attention kernel's result depending only on the keys a node
        sees, a sequence's logits do not depend on the other sequences in the batch nor on the
        draft tree around a node: plain and speculative decoding give the same tokens in
        bfloat16 too, at every batch size, and a prompt prefilled beside verification rows gets
        the logits it gets alone."""
        steps = [_FusedStep(segment, first_row, cache) for segment, first_row in
                 zip(segments, _first_rows(segments))]
        code, eps, hidden = DTYPE_CODES[self.dtype], self.eps, self.hidden_size
        cos, sin = self.rotary_tables(cache.capacity)
        ids = torch.cat([s.batch.input_ids.reshape(-1) for s in segments]) \
            if len(segments) > 1 else segments[0].batch.input_ids.reshape(-1)
        num_tokens = ids.shape[0]
        num_rows = max(num_tokens, self.min_rows)
        if num_rows > num_tokens:
            ids = torch.cat([ids, ids[-1:].expand(num_rows - num_tokens)])
        x = F.embedding(ids, self.embed)  # [num_rows, hidden_size]
        normed = torch.empty_like(x)
        q_width = self.num_heads * self.head_dim
        queries = torch.zeros(num_rows, q_width, dtype=self.dtype)
        attended = torch.zeros(num_rows, q_width, dtype=self.dtype)
        activated = torch.empty(num_rows, self.intermediate_size, dtype=self.dtype)
        x_ptr, normed_ptr, activated_ptr = (t.data_ptr() for t in (x, normed, activated))
        _kernels.rms_norm(x_ptr, self.layers[0].input_norm.data_ptr(), normed_ptr, num_rows,
                          hidden, eps, code)
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(normed)  # [num_rows, (heads + 2 kv_heads) head_dim]
            for step in steps:
                self._attend_fused(step, index, qkv, queries, attended, cache, cos, sin)
            # Every tensor a kernel reads is held by a name until the call returns.
            projected = layer.o(attended)  # [num_rows, hidden_size]
            _kernels.add_rms_norm(x_ptr, projected.data_ptr(), layer.post_norm.data_ptr(),
                                  normed_ptr, num_rows, hidden, eps, code)
            gate_up = layer.gate_up(normed)  # [num_rows, 2 intermediate_size]
            _kernels.silu_mul(gate_up.data_ptr(), activated_ptr, num_rows,
                              self.intermediate_size, code)
            projected = layer.down(activated)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) \
                else self.norm
            _kernels.add_rms_norm(x_ptr, projected.data_ptr(), following.data_ptr(), normed_ptr,
                                  num_rows, hidden, eps, code)
        return normed

    def _attend_fused(self, step: _FusedStep, layer: int, qkv: torch.Tensor,
                      queries: torch.Tensor, attended: torch.Tensor, cache: KVCache,
                      cos: torch.Tensor, sin: torch.Tensor) -> None:
        """One segment's rotary embedding, cache write and attention in layer `layer`: its rows
        of `attended` [num_rows, heads * head_dim] from its rows of `qkv`."""
        batch, heads = step.segment.batch, self.num_heads
        row_bytes = heads * self.head_dim * qkv.element_size()
        queries_ptr = queries.data_ptr() + step.first_row * row_bytes
        attended_ptr = attended.data_ptr() + step.first_row * row_bytes
        qkv_ptr = qkv.data_ptr() + step.first_row * qkv.shape[1] * qkv.element_size()
        layout = cache.layout
        _kernels.rope_and_store(layout, layer, step.rows, qkv_ptr, cos.data_ptr(),
                                sin.data_ptr(), queries_ptr, heads)
        if batch.tree_bits is not None:
            _kernels.attention(layout, layer, step.rows, queries_ptr, attended_ptr, heads,
                               self.scale)
        else:  # trees of more than MAX_TREE_BITS_NODES nodes: by PyTorch, with a mask
            num_seqs, num_nodes = batch.input_ids.shape
            tokens = slice(step.first_row, step.first_row + num_seqs * num_nodes)
            q = queries[tokens].view(num_seqs, num_nodes, heads, self.head_dim).transpose(1, 2)
            keys, values = cache.segment_kv(layer, step.segment)
            out = grouped_attention(q, keys, values, batch.attention_mask, self.scale)
            attended[tokens].copy_(out.transpose(1, 2).reshape(-1, heads * self.head_dim))


@dataclass
class _FusedStep:
    """A segment of a fused forward pass: its first row among the pass's, and its rows as the
    kernels read them (sssd._kernels.StepRows over the segment's tensors, which it keeps)."""

    segment: Segment
    first_row: int
    cache: KVCache

    def __post_init__(self) -> None:
        batch = self.segment.batch
        num_seqs, num_nodes = batch.input_ids.shape
        self.tables = self.cache.segment_tables(self.segment)
        self.rows = _kernels.StepRows(
            self.cache.layout, num_seqs, num_nodes, batch.cache_lens.data_ptr(),
            self.tables.data_ptr(), self.tables.shape[1],
            0 if batch.tree_bits is None else batch.tree_bits.data_ptr(),
            batch.position_ids.data_ptr())


def _wanted(x: torch.Tensor, segment: Segment) -> torch.Tensor:
    """The rows of a segment's hidden states x [num_tokens, hidden] whose logits it wants."""
    if segment.logit_tokens is None:
        return x
    return x[torch.tensor(segment.logit_tokens, dtype=torch.int64, device=x.device)]


def _first_rows(segments: Sequence[Segment]) -> list[int]:
    """Each segment's first row in a pass that runs them one after another."""
    first, rows = 0, []
    for segment in segments:
        rows.append(first)
        first += segment.batch.input_ids.numel()
    return rows


# One Decoder per loaded model: runners that share a model (a prefill and a decode worker in one
# process, the tests) share its prepacked weights too.
_decoders: weakref.WeakKeyDictionary[torch.nn.Module, Decoder] = weakref.WeakKeyDictionary()


def decoder_for(model: torch.nn.Module, impl: str) -> Decoder | None:
    """The Decoder of `model` for `impl` (MODEL_IMPLS), or None for the transformers forward.
    auto: the Decoder where the model's architecture is implemented, else the transformers
    forward with a log line saying why; sssd: raises UnsupportedModel where it is not."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {impl!r}")
    if impl == "transformers":
        return None
    reason = Decoder.supports(model)
    if reason is not None:
        if impl == "sssd":
            raise UnsupportedModel(f"the project's own forward pass does not implement {reason}")
        logger.info("the transformers forward pass (the project's own does not implement %s)",
                    reason)
        return None
    decoder = _decoders.get(model)
    if decoder is None:
        start = time.perf_counter()
        decoder = _decoders[model] = Decoder(model)
        logger.info("the project's own forward pass (%s, %s; weights prepared in %.1f s)",
                    model.config.model_type, str(decoder.dtype).removeprefix("torch."),
                    time.perf_counter() - start)
    return decoder
