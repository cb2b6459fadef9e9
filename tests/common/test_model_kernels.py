"""sssd._kernels, the forward pass's CPU operations, against float64 references computed here
with PyTorch: tree attention on each of its paths (AVX-512 with its scores on the vector units,
AVX-512 BF16's dot products or the AMX tile unit, AVX2, portable), a prompt's causal attention as
chains in rows, the row operations, the rotary cache write, the argmax, and the argument checks;
every attention read through block tables (kv_layout.h), whose blocks may lie anywhere in the
cache without changing a bit of the result."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sssd import _kernels
from sssd.common.model import kernel_paths

CODES = {torch.float32: 0, torch.bfloat16: 1}
# Largest error against the float64 reference: float32 accumulates in float32; bfloat16 rounds
# the output to 8 bits of mantissa (|values| of attention outputs stay below about 2).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
FEATURES = kernel_paths.cpu_features()
# The attention's paths, each where the CPU can run it, as kernel_paths.forced settings.
PATHS = {
    "amx": dict(tree_attention="avx512", attention_scores="amx"),
    "dpbf16": dict(tree_attention="avx512", attention_scores="dpbf16"),
    "avx512": dict(tree_attention="avx512", attention_scores="avx512"),
    "avx2": dict(tree_attention="avx2"),
    "portable": dict(tree_attention="portable", argmax="portable"),
}
CAN_RUN = {"amx": FEATURES["amx_bf16"], "dpbf16": FEATURES["avx512_bf16"],
           "avx512": FEATURES["avx512"], "avx2": FEATURES["avx2_fma"], "portable": True}


def skip_unless_it_applies(path, dtype):
    """The tile unit and the dot products take bfloat16 scores only: in float32 the amx and
    dpbf16 paths are the AVX-512 one."""
    if path in ("amx", "dpbf16") and dtype != torch.bfloat16:
        pytest.skip(f"the {path} scores are for bfloat16")


@pytest.fixture(params=list(PATHS))
def path(request):
    if not CAN_RUN[request.param]:
        pytest.skip(f"this CPU cannot run the {request.param} path")
    with kernel_paths.forced(**PATHS[request.param]):
        yield request.param


class Paged:
    """A one-layer paged cache (blocks [num_blocks, kv_heads, block_size, head_dim]) holding the
    rows of `keys` and `values` [num_seqs, kv_heads, length, head_dim] in blocks scattered at
    random, and the rows' block tables."""

    def __init__(self, keys, values, block_size, generator, spare_blocks=3):
        num_seqs, kv_heads, length, head_dim = keys.shape
        per_row = -(-length // block_size)
        num_blocks = num_seqs * per_row + spare_blocks
        order = torch.randperm(num_blocks, generator=generator)[: num_seqs * per_row]
        self.tables = order.view(num_seqs, per_row).to(torch.int32).contiguous()
        self.keys = torch.randn(num_blocks, kv_heads, block_size, head_dim,
                                generator=generator).to(keys.dtype)
        self.values = torch.randn_like(self.keys)
        padded = per_row * block_size
        for source, target in ((keys, self.keys), (values, self.values)):
            rows = torch.zeros(num_seqs, kv_heads, padded, head_dim, dtype=keys.dtype)
            rows[:, :, :length] = source
            blocks = rows.view(num_seqs, kv_heads, per_row, block_size, head_dim) \
                .permute(0, 2, 1, 3, 4).reshape(-1, kv_heads, block_size, head_dim)
            target[self.tables.view(-1).long()] = blocks
        self.layout = _kernels.KvLayout([self.keys.data_ptr()], [self.values.data_ptr()],
                                        num_blocks, block_size, kv_heads, head_dim,
                                        CODES[keys.dtype])

    def rows(self, cache_lens, num_nodes, bits=None, positions=None):
        """sssd._kernels.StepRows over tensors this object keeps alive."""
        assert len(cache_lens) <= self.tables.shape[0], "a row without a block table"
        self._lens = torch.tensor(cache_lens, dtype=torch.int64)
        self._bits = None if bits is None else as_tensor(bits)
        num_seqs = len(cache_lens)
        self._positions = positions if positions is not None else \
            torch.zeros(num_seqs * num_nodes, dtype=torch.int64)
        return _kernels.StepRows(self.layout, num_seqs, num_nodes, self._lens.data_ptr(),
                                 self.tables.data_ptr(), self.tables.shape[1],
                                 0 if self._bits is None else self._bits.data_ptr(),
                                 self._positions.data_ptr())


def tree_bits(parents: list[int], padded_to: int) -> list[int]:
    """Bit a of node j set when j sees a (itself, its ancestors); padding sees itself."""
    bits = []
    for node, parent in enumerate(parents):
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << node))
    return bits + [1 << node for node in range(len(parents), padded_to)]


def as_tensor(bits: list[list[int]]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint64).view(np.int64))


def reference_attention(q, keys, values, cache_lens, bits, scale):
    """float64, one query at a time over exactly the keys it sees; keys and values dense,
    [num_seqs, kv_heads, length, head_dim]."""
    num_seqs, num_nodes, heads, head_dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(num_seqs, num_nodes, heads, head_dim, dtype=torch.float64)
    for s in range(num_seqs):
        cached = cache_lens[s]
        for j in range(num_nodes):
            visible = list(range(cached)) + [cached + a for a in range(num_nodes)
                                              if bits[s][j] >> a & 1]
            for h in range(heads):
                k = keys[s, h // group, visible].double()
                v = values[s, h // group, visible].double()
                weights = torch.softmax(k @ q[s, j, h].double() * scale, dim=0)
                out[s, j, h] = weights @ v
    return out


def run_attention(q, cache, cache_lens, bits, scale):
    num_seqs, num_nodes, heads, head_dim = q.shape
    out = torch.empty(num_seqs, num_nodes, heads * head_dim, dtype=q.dtype)
    rows = cache.rows(cache_lens, num_nodes, bits)
    _kernels.attention(cache.layout, 0, rows, q.data_ptr(), out.data_ptr(), heads, scale)
    return out.view(num_seqs, num_nodes, heads, head_dim)


def random_case(generator, dtype, heads, kv_heads, head_dim, num_seqs, num_nodes, capacity=160):
    keys = torch.randn(num_seqs, kv_heads, capacity, head_dim, generator=generator).to(dtype)
    values = torch.randn(num_seqs, kv_heads, capacity, head_dim, generator=generator).to(dtype)
    q = torch.randn(num_seqs, num_nodes, heads, head_dim, generator=generator).to(dtype)
    cache_lens = torch.randint(0, capacity - num_nodes, (num_seqs,), generator=generator).tolist()
    bits = []
    for _ in range(num_seqs):
        real = int(torch.randint(1, num_nodes + 1, (1,), generator=generator))
        parents = [-1] + [int(torch.randint(0, j, (1,), generator=generator))
                          for j in range(1, real)]
        bits.append(tree_bits(parents, num_nodes))
    return q, keys, values, cache_lens, bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128), (4, 4, 32)],
                         ids=["smollm2", "qwen2.5-1.5b", "odd-head-dim"])
@pytest.mark.parametrize("num_seqs,num_nodes", [(1, 1), (3, 1), (2, 7), (1, 64)])
def test_attention_matches_the_float64_reference(path, dtype, shape, num_seqs, num_nodes):
    skip_unless_it_applies(path, dtype)
    assert_matches_reference(dtype, shape, num_seqs, num_nodes, 160, num_seqs * 100 + num_nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128)], ids=["smollm2", "qwen2.5-1.5b"])
def test_attention_over_contexts_of_many_segments_matches_the_float64_reference(
        path, dtype, shape):
    """Contexts long enough (up to 1,400 keys) that the AVX-512 and AVX2 attention cut a
    query's keys into segments and merge their partial results."""
    skip_unless_it_applies(path, dtype)
    for num_seqs, num_nodes in ((1, 1), (1, 33), (2, 7)):
        assert_matches_reference(dtype, shape, num_seqs, num_nodes, 1400, 1400 + num_nodes)


def assert_matches_reference(dtype, shape, num_seqs, num_nodes, capacity, seed):
    """A random case of up to `capacity` keys a row against the float64 reference."""
    heads, kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(seed)
    q, keys, values, cache_lens, bits = random_case(generator, dtype, heads, kv_heads, head_dim,
                                                    num_seqs, num_nodes, capacity)
    scale = head_dim ** -0.5
    out = run_attention(q, Paged(keys, values, 16, generator), cache_lens, bits, scale)
    expected = reference_attention(q, keys, values, cache_lens, bits, scale)
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128)], ids=["smollm2", "qwen2.5-1.5b"])
@pytest.mark.parametrize("length,cache_len,others", [(208, 150, (3, 166, 90)),
                                                     (1104, 566, (3, 1030, 290))],
                         ids=["one-segment", "segments"])
def test_a_querys_result_depends_neither_on_its_neighbours_nor_on_the_blocks(
        path, dtype, shape, length, cache_len, others):
    """The root of a tree gives bit-identical outputs alone, under any tree, padded, beside
    other rows, and whether its keys lie in one block or in blocks of 16 or 48 positions
    scattered over the cache: what makes speculative decoding token-identical to plain decoding
    in bf16, with the cache paged. With 566 cached keys the AVX-512 attention cuts a query's
    keys into segments, and a chain of 33 nodes crosses where its queries' segments change
    (the root's last segment starts at 256, node 32's at 512); alone, the row's segments are
    shared out among the threads, beside three other rows they are not."""
    skip_unless_it_applies(path, dtype)
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim = shape
    keys = torch.randn(4, kv_heads, length, head_dim, generator=generator).to(dtype)
    values = torch.randn(4, kv_heads, length, head_dim, generator=generator).to(dtype)
    q = torch.randn(4, 33, heads, head_dim, generator=generator).to(dtype)
    one_block = Paged(keys, values, length, generator, spare_blocks=0)
    alone = run_attention(q[:1, :1].contiguous(), one_block, [cache_len], [[1]], 0.125)
    chain = tree_bits(list(range(-1, 32)), 33)
    bushy = tree_bits([-1] + [0] * 16, 33)  # 17 real nodes, 16 of padding
    for cache in (one_block, Paged(keys, values, 16, generator),
                  Paged(keys, values, 48, generator)):
        assert torch.equal(run_attention(q[:1, :1].contiguous(), cache, [cache_len], [[1]],
                                         0.125), alone)
        for bits in (chain, bushy):
            out = run_attention(q[:1].contiguous(), cache, [cache_len], [bits], 0.125)
            assert torch.equal(out[0, 0], alone[0, 0])
        # Batched: row 0 beside three others of other lengths.
        out = run_attention(q.contiguous(), cache, [cache_len, *others],
                            [chain, bushy, chain, bushy], 0.125)
        assert torch.equal(out[0, 0], alone[0, 0])
    # A chain's node 5 (and 32) sees exactly what node 0 of a one-node step at cache_len + 5
    # (+ 32) sees, once the keys of the nodes before it are in the cache at those positions.
    out = run_attention(q[:1].contiguous(), one_block, [cache_len], [chain], 0.125)
    for node in (5, 32):
        later = run_attention(q[:1, node:node + 1].contiguous(), one_block, [cache_len + node],
                              [[1]], 0.125)
        assert torch.equal(out[0, node], later[0, 0]), node
    # A bushy tree's node 9 sees the root and itself, 9 positions apart: the same as a one-node
    # step right after the root, its own key and value moved next to the root's.
    out = run_attention(q[:1].contiguous(), one_block, [cache_len], [bushy], 0.125)
    moved_keys, moved_values = keys.clone(), values.clone()
    moved_keys[0, :, cache_len + 1] = keys[0, :, cache_len + 9]
    moved_values[0, :, cache_len + 1] = values[0, :, cache_len + 9]
    moved = Paged(moved_keys, moved_values, 16, generator)
    later = run_attention(q[:1, 9:10].contiguous(), moved, [cache_len + 1], [[1]], 0.125)
    assert torch.equal(out[0, 9], later[0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_len", [40, 250, 500, 760])
def test_a_tree_node_sees_what_decoding_its_path_alone_sees(path, dtype, cache_len):
    """Each node of a tree gives the same bits as a one-node step after its ancestors alone,
    their keys and values moved next to the cache: what speculation's exactness rests on. The
    tree is a root with 16 children, then a chain of 16 under the last child, so a deep node's
    ancestors lie in the step with gaps between them; at 250, 500 and 760 cached keys its
    visible keys reach past a multiple of 256 (where the AVX-512 attention's segments of a
    query with fewer keys would end)."""
    skip_unless_it_applies(path, dtype)
    generator = torch.Generator().manual_seed(cache_len)
    heads, kv_heads, head_dim = 9, 3, 64
    parents = [-1] + [0] * 16 + list(range(16, 32))
    bits = tree_bits(parents, len(parents))
    length = -(-(cache_len + len(parents)) // 16) * 16
    keys = torch.randn(1, kv_heads, length, head_dim, generator=generator).to(dtype)
    values = torch.randn(1, kv_heads, length, head_dim, generator=generator).to(dtype)
    q = torch.randn(1, len(parents), heads, head_dim, generator=generator).to(dtype)
    out = run_attention(q, Paged(keys, values, 16, generator), [cache_len], [bits], 0.125)
    for node in (9, 16, 20, 32):
        path_nodes = [a for a in range(len(parents)) if bits[node] >> a & 1]
        moved_keys, moved_values = keys.clone(), values.clone()
        for depth, a in enumerate(path_nodes):
            moved_keys[0, :, cache_len + depth] = keys[0, :, cache_len + a]
            moved_values[0, :, cache_len + depth] = values[0, :, cache_len + a]
        alone = run_attention(q[:, node:node + 1].contiguous(),
                              Paged(moved_keys, moved_values, 16, generator),
                              [cache_len + len(path_nodes) - 1], [[1]], 0.125)
        assert torch.equal(out[0, node], alone[0, 0]), node


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("length", [150, 700])
def test_a_prompt_as_rows_of_chains_gives_each_position_what_decoding_gives_it(
        path, dtype, length):
    """A prompt is prefilled as chains of up to 64 tokens a row, each row after the ones before
    it, in one call, however it is cut into chunks; every position comes out the same bits as a
    one-node step at that position: a position's keys and values are the same whether it was
    prefilled (whole or in chunks) or decoded, which makes the prefix cache exact. At 700
    positions the AVX-512 attention's segments change inside some rows."""
    skip_unless_it_applies(path, dtype)
    generator = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim = 9, 3, 64
    # blocks for the last row's padding nodes past the prompt too
    keys = torch.randn(1, kv_heads, length + 64, head_dim, generator=generator).to(dtype)
    values = torch.randn(1, kv_heads, length + 64, head_dim, generator=generator).to(dtype)
    q = torch.randn(length, heads, head_dim, generator=generator).to(dtype)
    cache = Paged(keys, values, 16, generator)

    def as_rows(start, end, width=64):
        """Positions [start, end) as chains of `width`, in one attention call."""
        starts = list(range(start, end, width))
        cache_rows = Paged.__new__(Paged)
        cache_rows.layout = cache.layout
        cache_rows.tables = cache.tables.expand(len(starts), -1).contiguous()
        rows_q = torch.zeros(len(starts), width, heads, head_dim, dtype=dtype)
        for r, first in enumerate(starts):
            rows_q[r, :min(width, end - first)] = q[first:min(first + width, end)]
        chain = [(1 << (j + 1)) - 1 if j < 63 else (1 << 64) - 1 for j in range(width)]
        out = run_attention(rows_q, cache_rows, starts, [chain] * len(starts), 0.125)
        return torch.cat([out[r, :min(width, end - first)] for r, first in enumerate(starts)])

    decoded = torch.cat([run_attention(q[p:p + 1].unsqueeze(0).contiguous(), cache, [p], [[1]],
                                       0.125)[0] for p in range(length)])
    assert torch.equal(as_rows(0, length), decoded)
    for cuts in ((0, 37, 100, length), (0, 64, 65, length), (0, 1, length)):
        pieces = [as_rows(a, b) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(pieces), decoded), cuts


def test_attention_and_its_rows_refuse_what_they_cannot_compute():
    generator = torch.Generator().manual_seed(0)
    keys = torch.zeros(1, 2, 128, 64)
    cache = Paged(keys, keys, 16, generator)
    q = torch.zeros(1, 65, 4, 64)
    out = torch.zeros(1, 65, 256)
    rows = cache.rows([0], 65, [[1] * 65])
    with pytest.raises(ValueError, match="1 to 64 nodes"):
        _kernels.attention(cache.layout, 0, rows, q.data_ptr(), out.data_ptr(), 4, 0.125)
    rows = cache.rows([0], 1, [[1]])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        _kernels.attention(cache.layout, 0, rows, q.data_ptr(), out.data_ptr(), 3, 0.125)
    with pytest.raises(ValueError, match="layer 1 of 1"):
        _kernels.attention(cache.layout, 1, rows, q.data_ptr(), out.data_ptr(), 4, 0.125)
    with pytest.raises(ValueError, match="exceed its block table"):
        cache.rows([100], 40, [[1] * 40])
    cache.tables[0, 0] = cache.layout.num_blocks  # a block past the cache
    with pytest.raises(ValueError, match="outside the cache"):
        cache.rows([0], 1, [[1]])
    with pytest.raises(ValueError, match="multiple of 16"):
        _kernels.KvLayout([keys.data_ptr()], [keys.data_ptr()], 1, 24, 1, 64, 0)
    with pytest.raises(ValueError, match="dtype code"):
        _kernels.rms_norm(q.data_ptr(), q.data_ptr(), q.data_ptr(), 1, 64, 1e-5, 2)


def transformers_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 40])  # 40: the rows are split between threads
def test_row_operations_match_transformers(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    dim, inter, eps, code = 576, 1536, 1e-5, CODES[dtype]
    x = (3 * torch.randn(rows, dim, generator=generator)).to(dtype)
    y = torch.randn(rows, dim, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(dim, generator=generator)).to(dtype)
    out = torch.empty_like(x)
    _kernels.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps, code)
    expected = transformers_rms_norm(x, weight, eps)
    ulp = 1e-6 if dtype == torch.float32 else 1.6e-2  # one rounding of the output at most
    assert torch.allclose(out.float(), expected.float(), rtol=ulp, atol=ulp)

    residual = x.clone()
    _kernels.add_rms_norm(residual.data_ptr(), y.data_ptr(), weight.data_ptr(), out.data_ptr(),
                          rows, dim, eps, code)
    assert torch.equal(residual, x + y)  # the residual stream, rounded as transformers does
    assert torch.allclose(out.float(), transformers_rms_norm(x + y, weight, eps).float(),
                          rtol=ulp, atol=ulp)

    gate_up = torch.randn(rows, 2 * inter, generator=generator).to(dtype)
    activated = torch.empty(rows, inter, dtype=dtype)
    _kernels.silu_mul(gate_up.data_ptr(), activated.data_ptr(), rows, inter, code)
    gate, up = gate_up.split(inter, dim=-1)
    assert torch.allclose(activated.float(), (F.silu(gate) * up).float(), rtol=2 * ulp,
                          atol=ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_and_store_rotates_and_writes_each_token_into_its_block(dtype):
    generator = torch.Generator().manual_seed(3)
    num_seqs, num_nodes, heads, kv_heads, head_dim, block = 2, 3, 4, 2, 64, 16
    qkv = torch.randn(num_seqs * num_nodes, (heads + 2 * kv_heads) * head_dim,
                      generator=generator).to(dtype)
    angles = torch.arange(64).unsqueeze(1) * 0.1 * torch.arange(1, head_dim + 1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    key_blocks = torch.zeros(6, kv_heads, block, head_dim, dtype=dtype)
    value_blocks = torch.zeros_like(key_blocks)
    layout = _kernels.KvLayout([key_blocks.data_ptr()], [value_blocks.data_ptr()], 6, block,
                               kv_heads, head_dim, CODES[dtype])
    cache_lens = torch.tensor([5, 14], dtype=torch.int64)  # row 1's nodes cross a block's end
    tables = torch.tensor([[4, 0], [2, 5]], dtype=torch.int32)
    positions = torch.tensor([5, 6, 6, 14, 15, 16], dtype=torch.int64)  # a tree, a chain
    queries = torch.empty(num_seqs, num_nodes, heads, head_dim, dtype=dtype)
    rows = _kernels.StepRows(layout, num_seqs, num_nodes, cache_lens.data_ptr(),
                             tables.data_ptr(), 2, 0, positions.data_ptr())
    _kernels.rope_and_store(layout, 0, rows, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                            queries.data_ptr(), heads)

    def rotate(x, position):  # transformers' rotate_half form, rounded once per product
        half = head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[position] + rotated * sin[position]

    q, k, v = qkv.view(num_seqs, num_nodes, -1).split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    tolerance = 1e-6 if dtype == torch.float32 else 1.6e-2
    for s in range(num_seqs):
        for j in range(num_nodes):
            position = int(positions[s * num_nodes + j])
            place = int(cache_lens[s]) + j
            where = (int(tables[s, place // block]), slice(None), place % block)
            expected_q = rotate(q[s, j].view(heads, head_dim), position)
            assert torch.allclose(queries[s, j].float(), expected_q.float(), atol=tolerance,
                                  rtol=tolerance)
            expected_k = rotate(k[s, j].view(kv_heads, head_dim), position)
            assert torch.allclose(key_blocks[where].float(), expected_k.float(),
                                  atol=tolerance, rtol=tolerance)
            assert torch.equal(value_blocks[where], v[s, j].view(kv_heads, head_dim))
    written = key_blocks.abs().sum(dim=(1, 3)) > 0  # [blocks, block]
    assert written.sum().item() == num_seqs * num_nodes  # nothing else touched
    assert not written[1].any() and not written[3].any() and not written[0].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [1, 17, 100, 49152, 151936])  # odd tails; both models' rows
@pytest.mark.parametrize("argmax_path", ["avx512", "portable"])  # no AVX2 argmax
def test_argmax_gives_torchs_indices(argmax_path, dtype, vocab):
    """Greedy verification's token per node: the same index as torch.argmax on every row, ties
    to the first maximum, a NaN counted as the maximum (its first), -0.0 equal to 0.0, and
    bfloat16 logits read as torch reads them."""
    from sssd.common.model.argmax import argmax_last

    if not CAN_RUN[argmax_path]:
        pytest.skip(f"this CPU cannot run the {argmax_path} path")
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, 3, vocab, generator=generator).to(dtype)
    cases = [logits, logits[0, 0], logits[:, 1:]]  # rows, one row, a strided view of rows
    tied = logits.clone()
    tied[..., vocab // 2] = 7.0
    tied[..., vocab // 3] = 7.0  # the first of the two maxima wins
    cases.append(tied)
    with_nan = tied.clone()
    with_nan[:2, :, vocab - 1] = float("nan")
    with_nan[:1, :, vocab // 4] = float("nan")
    cases.append(with_nan)
    zeros = torch.zeros(4, vocab, dtype=dtype)
    zeros[:, vocab // 2] = -0.0
    cases += [zeros, torch.full((3, vocab), float("-inf"), dtype=dtype)]
    with kernel_paths.forced(argmax=argmax_path):
        for case in cases:
            got = argmax_last(case)
            assert got.dtype == torch.int64 and torch.equal(got, case.argmax(-1))
