"""The decoder layer's operations as PyTorch computes them: the path of the transformers-free
forward on GPUs and wherever sssd._kernels does not apply, and the references the kernels are
tested against. Each reduces over keys in an order that does not depend on the rows beside it
(see the docstrings): the batch-invariance that makes speculation exact in bfloat16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


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
    num_nodes, head_dim]. On CPUs, PyTorch's fused bfloat16 kernel is far slower for a few
    queries over a long cache."""
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
