"""The project's own forward pass for decoder-only transformers of the Llama and Qwen2 families
(SmolLM2, Qwen2.5): the transformers model is the weight loader and the exactness reference, and
this is what runs every step of the verifier's target model (verifier/engine/model_runner.py)
and of the speculator's draft model (speculator/runner.py, through `hidden_states`: its steps'
nodes see what a mask allows rather than a tree's ancestors).

A step of a small model on a CPU costs more in dispatch than in arithmetic when it goes through
the transformers modules, and a plain `linear` streams the weights at a fraction of the memory
bandwidth. Here each layer is a handful of tensor operations on weights prepared once:
- query, key and value projections fused into one matrix, gate and up projections into another,
  so a layer makes four matrix products;
- on CPUs with AVX-512 (and its BF16 instructions for a bfloat16 model), the products by
  sssd._kernels (linear_bf16, linear_f32), on weights packed in panels that a step reads as one
  stream: near the machine's read bandwidth from one row to eight, and a row's result
  independent of the rows beside it; on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2 and
  3, among others) the same panels by the kernels' AVX2 build, a bfloat16 weight widened to
  float32 in registers; a bfloat16 model on a CPU with AMX multiplies the same
  panels on the tile unit (linear_bf16_amx), which keeps a step at the cost of reading the
  weights up to 16 rows and more;
- elsewhere on CPUs with oneDNN, every weight prepacked in its blocked layout, which reads the
  weights at about twice the bandwidth of a plain `linear` and keeps a step nearly flat up to
  8-16 rows;
- rotary cosines and sines tabulated once for every cache position, by the model's own rotary
  module, so the positions are those of transformers (and every rope scaling it implements);
- attention over the slot KV cache, each node seeing the cached prefix, its ancestors and itself
  (the tree as a 64-bit mask per node: no mask tensor is built for a step); a prompt's causal
  attention by a kernel of its own (sssd._kernels.prompt_attention), tiled for the many
  queries that share its keys;
- the packed weights in one buffer on 2 MiB pages where the OS grants them (huge_pages.py): a
  step that streams them takes a TLB miss every 2 MiB instead of every 4 KiB;
- logits only for the rows asked for;
- on CPUs, what runs between the matrix products in one call each (sssd._kernels: RMSNorm with
  the residual add, rotary embedding with the cache write, attention, SiLU and product), where
  PyTorch would dispatch a dozen small operations per layer, each costing more than its work.

`Decoder.supports(model)` says whether a model can run here; `decoder_for` falls back to the
transformers forward otherwise, and logs why.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sssd import _kernels
from sssd.common.model.huge_pages import move_into_huge_pages
from sssd.common.model.impls import MODEL_IMPLS
from sssd.common.model.kv_cache import SlotKVCache
from sssd.common.model.tree_batch import TreeBatch

FAMILIES = ("llama", "qwen2")
# The fewest rows a product prepacked for oneDNN runs on (see _layers_fused): oneDNN rounds a
# lone row differently, and its kernels for 1-3 rows read the weights slower than its kernel for
# 4 (Qwen2.5-1.5B, bf16, every product of a step: 93 / 111 / 78 / 74 ms for 1 / 2 / 3 / 4 rows).
# The bfloat16 panels (linear_bf16) need no minimum.
MIN_PRODUCT_ROWS = 4
AMX_INPUTS = 32  # an AMX tile's inputs: linear_bf16_amx needs in_features a multiple of it
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # sssd._kernels' Dtype

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """One step's rows in a forward pass that may hold several: a batch of trees over cache
    slots [first_slot, first_slot + its batch size)."""

    batch: TreeBatch
    first_slot: int
    logits_to_keep: int = 0  # logits for each row's last positions only (0: every node)
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


def _oneDNN_usable(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and \
        torch.backends.mkldnn.is_available() and _oneDNN_packs(dtype)


@functools.cache
def _oneDNN_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks a weight of this dtype on this CPU: its bfloat16 products need
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and on an AVX2-only CPU (AMD Zen 2 and 3, say) the
    prepacking raises instead."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def _panels_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether sssd._kernels' panel products run this dtype here: float32 or bfloat16 on a CPU
    with AVX-512 (and its BF16 instructions for the AVX-512 bfloat16 build) or with AVX2 and
    FMA (sssd._kernels.panels_instructions says which build)."""
    code = DTYPE_CODES.get(dtype)
    return device.type == "cpu" and code is not None and \
        _kernels.panels_instructions(code) != ""


def _amx_usable(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and _kernels.has_amx_bf16()


def argmax_last(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the same indices (the first maximum; a NaN counts as the maximum),
    by sssd._kernels.argmax_rows where the logits are a CPU tensor of float32 or bfloat16 whose
    last dimension is contiguous: torch's argmax scans a bfloat16 row without vectorizing (2.1
    ms of a 25 ms step of SmolLM2 at b = 8 with trees of 2 nodes; 16 ms with trees of 16)."""
    code = DTYPE_CODES.get(logits.dtype)
    if logits.device.type != "cpu" or code is None or logits.dim() == 0 or \
            logits.shape[-1] == 0 or logits.stride(-1) != 1:
        return logits.argmax(-1)
    rows = logits.reshape(-1, logits.shape[-1])  # a view where the rows are evenly strided
    if rows.stride(0) != rows.shape[1]:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if rows.shape[0]:
        _kernels.argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], code, out.data_ptr())
    return out.reshape(logits.shape[:-1])


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out_features, in_features] as the panels of 64 outputs of sssd._kernels'
    products, the last panel's missing outputs zero: bfloat16 (linear_bf16) [num_panels,
    in_features / 2, 64, 2], float32 (linear_f32) [num_panels, in_features, 64]."""
    out_features, in_features = weight.shape
    num_panels = _kernels.packed_bf16_panels(out_features)
    padded = weight
    if num_panels * 64 != out_features:
        padded = torch.zeros(num_panels * 64, in_features, dtype=weight.dtype)
        padded[:out_features] = weight
    if weight.dtype == torch.float32:
        return padded.view(num_panels, 64, in_features).transpose(1, 2).contiguous()
    return padded.view(num_panels, 64, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


class Linear:
    """y = x W^T (+ b) for x [num_rows, in_features]. Where the weights are kept:
    - "panels": packed for sssd._kernels.linear_bf16 (bfloat16) or linear_f32 (float32), on a
      CPU with AVX-512 or with AVX2 and FMA;
    - "amx": the same panels, multiplied on the AMX tile unit (sssd._kernels.linear_bf16_amx;
      bfloat16, in_features a multiple of 32);
    - "onednn": prepacked for oneDNN (CPU, float32 or bfloat16);
    - "plain": as given, for `F.linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str) -> None:
        # weight: [out_features, in_features]
        self.bias = None if bias is None else bias.contiguous()
        self.layout = layout
        self.out_features, self.in_features = weight.shape
        if layout == "panels":
            if weight.dtype not in (torch.bfloat16, torch.float32) or self.in_features % 2:
                raise ValueError(f"panels need a bfloat16 or float32 weight of an even width, "
                                 f"got {weight.dtype} {tuple(weight.shape)}")
            self.weight = pack_panels(weight.contiguous())
        elif layout == "amx":
            if not _kernels.has_amx_bf16():
                raise ValueError("this CPU (or its OS) offers no AMX bfloat16 tiles")
            if weight.dtype != torch.bfloat16 or self.in_features % AMX_INPUTS:
                raise ValueError(f"AMX products need a bfloat16 weight whose width is a multiple "
                                 f"of {AMX_INPUTS}, got {weight.dtype} {tuple(weight.shape)}")
            self.weight = pack_panels(weight.contiguous())
        elif layout == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        elif layout == "plain":
            self.weight = weight
        else:
            raise ValueError(f"unknown weight layout {layout!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout in ("panels", "amx"):
            x = x.contiguous()
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            product = _kernels.linear_bf16_amx if self.layout == "amx" else \
                _kernels.linear_f32 if x.dtype == torch.float32 else _kernels.linear_bf16
            product(x.data_ptr(), self.weight.data_ptr(),
                    0 if self.bias is None else self.bias.data_ptr(), out.data_ptr(), x.shape[0],
                    self.in_features, self.out_features)
            return out
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' Llama/Qwen2 RMSNorm: in float32, then back to x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention by two matrix products, the query heads of a key head side by side (no copy
    of the keys per query head) and the softmax in float32.

    q [num_seqs, heads, num_nodes, head_dim], keys and values [num_seqs, kv_heads, kv_len,
    head_dim], mask [num_seqs, 1, num_nodes, kv_len] additive; returns [num_seqs, heads,
    num_nodes, head_dim]. On CPUs, PyTorch's fused bfloat16 kernel takes about ten times as
    long for a few queries over a long cache (2 ms against 0.2 ms a layer at 8 x 1 x 384)."""
    num_seqs, num_heads, num_nodes, head_dim = q.shape
    num_kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    scores = torch.matmul(q.reshape(num_seqs, num_kv_heads, group * num_nodes, head_dim),
                          keys.transpose(-1, -2))  # [num_seqs, kv_heads, group * nodes, kv_len]
    scores = scores.view(num_seqs, num_kv_heads, group, num_nodes, kv_len).float() * scale \
        + mask.view(num_seqs, 1, 1, num_nodes, kv_len)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    attended = torch.matmul(probs.view(num_seqs, num_kv_heads, group * num_nodes, kv_len),
                            values)  # [num_seqs, kv_heads, group * nodes, head_dim]
    return attended.view(num_seqs, num_heads, num_nodes, head_dim)


def prompt_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of a prompt over its own keys: q [1, heads, n, head_dim], keys and
    values [1, kv_heads, n, head_dim]. PyTorch's flash kernel, which works through the keys in
    blocks and never holds the n x n scores: on 2 CPU cores it takes 10 ms a layer for 1,024
    tokens of SmolLM2 against 45 ms for grouped_attention's two products, whose float32 scores
    (and the mask they add) grow with the square of the prompt. Each query row's result
    depends on the prompt alone, so a prompt prefilled beside other rows gets the logits it
    gets alone. On CPUs with AVX-512 the fused forward takes sssd._kernels.prompt_attention
    instead (3.2 ms a layer there, tiles of queries against transposed keys); this is where
    that does not apply, and the PyTorch forward's."""
    return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale,
                                          enable_gqa=keys.shape[1] != q.shape[1])


def _memory_efficient_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           mask: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch's fused attention, on CUDA by its memory-efficient kernel alone (see
    efficient_attention); elsewhere PyTorch's own choice."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def efficient_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention by PyTorch's memory-efficient kernel alone (on CUDA; elsewhere the default
    choice), the query heads of a key head stacked as its query rows, so that grouped-query
    models run without a copy of the keys per query head (the kernel takes no grouped heads).

    Shapes as grouped_attention's. The kernel computes every query row apart, over the keys in
    blocks of a fixed size, in order: a row's result depends neither on the other rows of its
    tile nor on how many there are, and masked keys past the row's own add exact zeros. The
    other choices do not promise that: the math path's products change algorithm with the shape,
    and the flash kernel takes no mask."""
    num_seqs, num_heads, num_nodes, head_dim = q.shape
    num_kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    q = q.reshape(num_seqs, num_kv_heads, group * num_nodes, head_dim)
    if group > 1:  # query row g * num_nodes + j is node j of query head g of its key head
        mask = mask.unsqueeze(2).expand(num_seqs, 1, group, num_nodes, kv_len) \
            .reshape(num_seqs, 1, group * num_nodes, kv_len)
    out = _memory_efficient_sdpa(q, keys, values, mask, scale)
    return out.reshape(num_seqs, num_heads, num_nodes, head_dim)  # CUDA: not contiguous


def path_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   positions: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention with every node a sequence of its own: the keys and values at `positions`
    (TreeBatch.path_keys: the prefix, the node's ancestors and itself, in text order) gathered
    per node, and its query heads of a key head as the query rows of one kernel call.

    Shapes as grouped_attention's; positions [num_seqs, num_nodes, kv_len], mask [num_seqs *
    num_nodes, 1, group rows, kv_len] additive. In a tree, a node's ancestors are not where
    plain decoding has them (node indices, not depths, past the prefix): an attention kernel
    that sums the keys block by block would add the same terms in another grouping, and round
    differently. Gathered, the node's keys are at plain decoding's offsets, and its query tile
    is plain decoding's too (its own query heads, whatever the tree). The cost: a copy of each
    node's keys and values per layer, small on a GPU at the context lengths of this engine; a
    kernel that reads the cache by position would make it none."""
    num_seqs, num_heads, num_nodes, head_dim = q.shape
    num_kv_heads, kv_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    rows = torch.arange(num_seqs, device=q.device).view(num_seqs, 1, 1)

    def per_node(cache: torch.Tensor) -> torch.Tensor:  # -> [seqs * nodes, kv_heads, kv_len, d]
        gathered = cache.transpose(1, 2)[rows, positions]  # [seqs, nodes, kv_len, kv_heads, d]
        return gathered.view(num_seqs * num_nodes, kv_len, num_kv_heads, head_dim).transpose(1, 2)

    q = q.transpose(1, 2).reshape(num_seqs * num_nodes, num_kv_heads, group, head_dim)
    out = _memory_efficient_sdpa(q, per_node(keys), per_node(values), mask, scale)
    # [seqs * nodes, kv_heads, group, d] -> [seqs, heads, nodes, d]
    return out.reshape(num_seqs, num_nodes, num_heads, head_dim).transpose(1, 2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [num_seqs, heads, num_nodes, head_dim], halves rotated."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Decoder:
    """The forward pass of a Llama or Qwen2 causal LM over the slot KV cache."""

    def __init__(self, model: torch.nn.Module, pack: bool | None = None,
                 fused: bool | None = None, panels: bool | None = None,
                 amx: bool | None = None) -> None:
        """`model`: a transformers LlamaForCausalLM or Qwen2ForCausalLM (UnsupportedModel
        otherwise); its weights are shared, or copied into prepacked form when `pack` (default:
        where oneDNN or the panels can run them). `panels`: a packed model's products by
        sssd._kernels (linear_bf16, linear_f32) rather than oneDNN (default: where the CPU has
        AVX-512, or AVX2 and FMA; _panels_usable). `amx`: a bfloat16 model's panels
        multiplied on the AMX tile unit (linear_bf16_amx; default: where the CPU has one and
        every product's width is a multiple of AMX_INPUTS).
        `fused`: the layer's small operations by sssd._kernels (default: on the CPU, in float32
        or bfloat16)."""
        self.check(model)
        config = model.config
        inner = model.model
        weight = inner.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        onednn = _oneDNN_usable(self.dtype, self.device)
        if pack is None:  # the panels pack too, where oneDNN cannot (bfloat16 on AVX2)
            pack = onednn or _panels_usable(self.dtype, self.device)
        self.pack = pack
        even = config.hidden_size % 2 == 0 and \
            inner.layers[0].mlp.gate_proj.weight.shape[0] % 2 == 0
        if panels is None:
            panels = pack and even and _panels_usable(self.dtype, self.device)
        elif panels and not (even and _panels_usable(self.dtype, self.device)):
            raise ValueError("the panels need a float32 or bfloat16 model of even widths on a "
                             "CPU with AVX-512 or with AVX2 and FMA")
        widths = (config.hidden_size, config.num_attention_heads * (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
            inner.layers[0].mlp.gate_proj.weight.shape[0])
        amx_fits = panels and _amx_usable(self.dtype, self.device) and \
            all(w % AMX_INPUTS == 0 for w in widths)
        if amx is None:
            amx = amx_fits
        elif amx and not amx_fits:
            raise ValueError(f"AMX products need a bfloat16 model whose widths are multiples of "
                             f"{AMX_INPUTS}, on a CPU with AMX (and the panels on)")
        if pack and not (panels or onednn):
            raise ValueError(f"oneDNN cannot prepack a {self.dtype} model on this CPU; "
                             "pack=False keeps the weights as they are")
        self.layout = "amx" if amx else "panels" if panels else "onednn" if pack else "plain"
        # oneDNN's products run on at least MIN_PRODUCT_ROWS rows (see _layers_fused)
        self.min_rows = MIN_PRODUCT_ROWS if self.layout == "onednn" else 1
        layout = self.layout
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.rotary = inner.rotary_emb  # transformers' positions, cos and sin, exactly
        self.embed = weight  # [vocab_size, hidden_size]
        self.layers = []
        for layer in inner.layers:
            attention, mlp = layer.self_attn, layer.mlp
            qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight,
                qkv=Linear(torch.cat([m.weight for m in qkv]), _cat_bias(*qkv), layout),
                o=Linear(attention.o_proj.weight, attention.o_proj.bias, layout),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                               _cat_bias(mlp.gate_proj, mlp.up_proj), layout),
                down=Linear(mlp.down_proj.weight, mlp.down_proj.bias, layout)))
        self.norm = inner.norm.weight
        head = model.get_output_embeddings()
        self.lm_head = Linear(head.weight, head.bias, layout)
        if layout in ("panels", "amx"):  # in the order a step reads them
            move_into_huge_pages([linear for entry in self.layers
                                  for linear in (entry.qkv, entry.o, entry.gate_up, entry.down)]
                                 + [self.lm_head])
        self.vocab_size = head.weight.shape[0]
        self.intermediate_size = inner.layers[0].mlp.gate_proj.weight.shape[0]
        self.scale = self.head_dim ** -0.5
        # PyTorch's fused kernel where it is fast and matches transformers' float32 logits to
        # rounding; two matrix products in bfloat16 on the CPU (see grouped_attention).
        self.fused_attention = not (self.device.type == "cpu" and self.dtype == torch.bfloat16)
        self.fused = fused if fused is not None else \
            self.device.type == "cpu" and self.dtype in DTYPE_CODES
        self.hidden_size = config.hidden_size
        empty = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)
        self._cos, self._sin = empty, empty  # rotary_tables

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
                         cache: SlotKVCache) -> list[torch.Tensor]:
        """One forward pass over the segments (verification rows and prompts together): writes
        every node's keys and values at its segment's write positions and returns each
        segment's logits [num_seqs, num_nodes or logits_to_keep, vocab_size] in the model's
        dtype. Each segment gets the logits a pass of its own would give, to the bit, since a
        row's products and attention do not depend on the rows beside it (see _layers_fused);
        the matrix products read the weights once for all of them."""
        if not self.fused:  # the PyTorch operations take one step at a time
            return [self._forward_unfused(segment, cache) for segment in segments]
        x = self._layers_fused(segments, cache)
        kept, offset = [], 0  # the rows that need logits, from every segment
        for segment in segments:
            num_seqs, num_nodes = segment.batch.input_ids.shape
            rows = x[offset:offset + num_seqs * num_nodes].view(num_seqs, num_nodes, -1)
            if segment.logits_to_keep:
                rows = rows[:, -segment.logits_to_keep:]
            kept.append(rows.reshape(-1, rows.shape[-1]))
            offset += num_seqs * num_nodes
        x = kept[0] if len(kept) == 1 else torch.cat(kept)
        logits = self.head(x)
        outputs, offset = [], 0
        for segment, rows in zip(segments, kept):
            num_seqs = segment.batch.input_ids.shape[0]
            outputs.append(logits[offset:offset + rows.shape[0]].view(num_seqs, -1,
                                                                      self.vocab_size))
            offset += rows.shape[0]
        return outputs

    def _forward_unfused(self, segment: Segment, cache: SlotKVCache) -> torch.Tensor:
        batch = segment.batch
        num_seqs, num_nodes = batch.input_ids.shape
        cache.begin_step(segment.first_slot, num_seqs, batch.write_positions, batch.kv_len)
        num_tokens = num_seqs * num_nodes
        x = self._layers(batch, cache, max(segment.num_rows, num_tokens),  # [rows, hidden]
                         segment.by_path)
        if segment.logits_to_keep:
            x = x[:num_tokens].view(num_seqs, num_nodes, -1)[:, -segment.logits_to_keep:]
            x = x.reshape(-1, x.shape[-1])
        kept = num_seqs * (segment.logits_to_keep or num_nodes)
        logits = self.head(rms_norm(x, self.norm, self.eps))  # padding rows too: one shape
        return logits[:kept].view(num_seqs, -1, self.vocab_size)

    def hidden_states(self, nodes: MaskedNodes, cache: SlotKVCache) -> torch.Tensor:
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

    def _layers(self, batch: TreeBatch | MaskedNodes, cache: SlotKVCache, num_rows: int,
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

    def _layers_fused(self, segments: Sequence[Segment], cache: SlotKVCache) -> torch.Tensor:
        """Every layer with sssd._kernels between the matrix products, the segments' tokens
        one after another as the rows of every product; returns the final norm of the hidden
        states [max(num_tokens, self.min_rows), hidden_size] (the first num_tokens rows are
        the segments', in order).

        The panels compute a row of a product the same way whatever the rows beside it. oneDNN
        does too from two rows up; a single row goes through a matrix-vector kernel that rounds
        differently. So with oneDNN a step of fewer than MIN_PRODUCT_ROWS tokens runs its
        products on that many rows (its last token repeated: the weights are read once either
        way, and faster with 4 rows than with 1 or 2). Either way, with the attention kernel's
        result depending only on the keys a node sees, a sequence's logits do not depend on the
        other sequences in the batch nor on the draft tree around a node: plain and speculative
        decoding give the same tokens in bfloat16 too, at every batch size, and a prompt
        prefilled beside verification rows gets the logits it gets alone."""
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        code, eps, hidden, capacity = DTYPE_CODES[self.dtype], self.eps, self.hidden_size, \
            cache.capacity
        for segment in segments:
            num_seqs = segment.batch.input_ids.shape[0]
            if segment.first_slot < 0 or segment.first_slot + num_seqs > cache.max_seqs:
                raise ValueError(f"slots [{segment.first_slot}, {segment.first_slot + num_seqs})"
                                 f" outside the cache's {cache.max_seqs}")
            if segment.batch.kv_len > capacity:
                raise ValueError(f"step needs {segment.batch.kv_len} cache positions, the cache "
                                 f"holds {capacity}")
        cos, sin = self.rotary_tables(capacity)
        ids = torch.cat([s.batch.input_ids.reshape(-1) for s in segments]) \
            if len(segments) > 1 else segments[0].batch.input_ids.reshape(-1)
        num_tokens = ids.shape[0]
        num_rows = max(num_tokens, self.min_rows)
        if num_rows > num_tokens:
            ids = torch.cat([ids, ids[-1:].expand(num_rows - num_tokens)])
        x = F.embedding(ids, self.embed)  # [num_rows, hidden_size]
        normed = torch.empty_like(x)
        q_width = num_heads * head_dim
        queries = torch.zeros(num_rows, q_width, dtype=self.dtype)
        attended = torch.zeros(num_rows, q_width, dtype=self.dtype)
        activated = torch.empty(num_rows, self.intermediate_size, dtype=self.dtype)
        x_ptr, normed_ptr, activated_ptr = (t.data_ptr() for t in (x, normed, activated))
        qkv_row_bytes = (num_heads + 2 * num_kv_heads) * head_dim * x.element_size()
        q_row_bytes = q_width * x.element_size()
        first_rows = [0]  # each segment's first row
        for segment in segments:
            first_rows.append(first_rows[-1] + segment.batch.input_ids.numel())
        _kernels.rms_norm(x_ptr, self.layers[0].input_norm.data_ptr(), normed_ptr, num_rows,
                          hidden, eps, code)
        for index, layer in enumerate(self.layers):
            keys, values = cache.keys[index], cache.values[index]
            qkv = layer.qkv(normed)  # [num_rows, (heads + 2 kv_heads) head_dim]
            for segment, first_row in zip(segments, first_rows):
                batch, first_slot = segment.batch, segment.first_slot
                num_seqs, num_nodes = batch.input_ids.shape
                queries_ptr = queries.data_ptr() + first_row * q_row_bytes
                attended_ptr = attended.data_ptr() + first_row * q_row_bytes
                _kernels.rope_and_store(
                    qkv.data_ptr() + first_row * qkv_row_bytes, cos.data_ptr(), sin.data_ptr(),
                    batch.position_ids.data_ptr(), queries_ptr, keys.data_ptr(),
                    values.data_ptr(), batch.cache_lens.data_ptr(), first_slot, num_seqs,
                    num_nodes, num_heads, num_kv_heads, head_dim, capacity, code)
                if batch.tree_bits is not None:
                    _kernels.attention(
                        queries_ptr, keys.data_ptr(), values.data_ptr(),
                        batch.cache_lens.data_ptr(), batch.tree_bits.data_ptr(), attended_ptr,
                        first_slot, num_seqs, num_nodes, num_heads, num_kv_heads, head_dim,
                        capacity, self.scale, code)
                elif not (batch.is_prompt and _kernels.prompt_attention(
                        queries_ptr, keys.data_ptr(), values.data_ptr(), attended_ptr,
                        first_slot, num_nodes, num_heads, num_kv_heads, head_dim, capacity,
                        self.scale, code)):
                    # beyond MAX_TREE_BITS_NODES: a prompt, mostly, where the CPU's own kernel
                    # does not apply (no AVX-512, another head size)
                    rows = slice(first_slot, first_slot + num_seqs)
                    tokens = slice(first_row, first_row + num_seqs * num_nodes)
                    q = queries[tokens].view(num_seqs, num_nodes, num_heads, head_dim) \
                        .transpose(1, 2)
                    if batch.is_prompt:  # [1, heads, nodes, head_dim]
                        out = prompt_attention(q, keys[rows, :, :num_nodes],
                                               values[rows, :, :num_nodes], self.scale)
                    else:
                        out = grouped_attention(
                            q, keys[rows, :, :batch.kv_len], values[rows, :, :batch.kv_len],
                            batch.attention_mask, self.scale)
                    attended[tokens].copy_(out.transpose(1, 2).reshape(-1, q_width))
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
