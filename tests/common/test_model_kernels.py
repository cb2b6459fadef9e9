"""sssd._kernels, the verifier's fused CPU operations, against float64 references computed here
with PyTorch: attention on each of its paths (AVX-512, AVX2 and portable), a prompt's causal
attention, the row operations, the rotary cache write, and the argument checks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sssd import _kernels

CODES = {torch.float32: 0, torch.bfloat16: 1}
# Largest error against the float64 reference: float32 accumulates in float32; bfloat16 rounds
# the output to 8 bits of mantissa (|values| of attention outputs stay below about 2).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
# The attention's paths, each where the CPU can run it: AVX-512 with its bfloat16 scores on the
# AMX tile unit, AVX-512 with them on AVX-512 BF16's dot products, AVX-512 alone, AVX2 (forced
# on a CPU that has AVX-512 too), and the portable loops. The argmax has two: its test picks
# them from these.
PATHS = ["amx", "dpbf16", "avx512", "avx2", "portable"]
CAN_RUN = {"amx": _kernels.has_amx_bf16,
           "dpbf16": lambda: _kernels.has_avx512() and _kernels.has_avx512_bf16(),
           "avx512": _kernels.has_avx512, "avx2": _kernels.has_avx2_fma,
           "portable": lambda: True}


def skip_unless_it_applies(path, dtype):
    """The tile unit and the dot products take bfloat16 scores only: in float32 the amx and
    dpbf16 paths are the AVX-512 one."""
    if path in ("amx", "dpbf16") and dtype != torch.bfloat16:
        pytest.skip(f"the {path} scores are for bfloat16")


@pytest.fixture(params=PATHS)
def path(request):
    if not CAN_RUN[request.param]():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    previous_portable = _kernels.set_portable(request.param == "portable")
    previous_avx2 = _kernels.set_attention_avx2(request.param == "avx2")
    previous_amx = _kernels.set_attention_amx(request.param == "amx")
    previous_dpbf16 = _kernels.set_attention_dpbf16(request.param == "dpbf16")
    yield request.param
    _kernels.set_portable(previous_portable)
    _kernels.set_attention_avx2(previous_avx2)
    _kernels.set_attention_amx(previous_amx)
    _kernels.set_attention_dpbf16(previous_dpbf16)


def tree_bits(parents: list[int], padded_to: int) -> list[int]:
    """Bit a of node j set when j sees a (itself, its ancestors); padding sees itself."""
    bits = []
    for node, parent in enumerate(parents):
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << node))
    return bits + [1 << node for node in range(len(parents), padded_to)]


def as_tensor(bits: list[list[int]]) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint64).view(np.int64))


def reference_attention(q, key_cache, value_cache, cache_lens, bits, first_slot, scale):
    """float64, one query at a time over exactly the keys it sees."""
    num_seqs, num_nodes, heads, head_dim = q.shape
    group = heads // key_cache.shape[1]
    out = torch.empty(num_seqs, num_nodes, heads, head_dim, dtype=torch.float64)
    for s in range(num_seqs):
        cached = cache_lens[s]
        for j in range(num_nodes):
            visible = list(range(cached)) + [cached + a for a in range(num_nodes)
                                              if bits[s][j] >> a & 1]
            for h in range(heads):
                keys = key_cache[first_slot + s, h // group, visible].double()
                values = value_cache[first_slot + s, h // group, visible].double()
                weights = torch.softmax(keys @ q[s, j, h].double() * scale, dim=0)
                out[s, j, h] = weights @ values
    return out


def run_attention(q, key_cache, value_cache, cache_lens, bits, first_slot, scale):
    num_seqs, num_nodes, heads, head_dim = q.shape
    out = torch.empty(num_seqs, num_nodes, heads * head_dim, dtype=q.dtype)
    lens = torch.tensor(cache_lens, dtype=torch.int64)
    bits_tensor = as_tensor(bits)
    _kernels.attention(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                       lens.data_ptr(), bits_tensor.data_ptr(), out.data_ptr(), first_slot,
                       num_seqs, num_nodes, heads, key_cache.shape[1], head_dim,
                       key_cache.shape[2], scale, CODES[q.dtype])
    return out.view(num_seqs, num_nodes, heads, head_dim)


def random_case(generator, dtype, heads, kv_heads, head_dim, num_seqs, num_nodes, capacity=160):
    key_cache = torch.randn(num_seqs + 2, kv_heads, capacity, head_dim, generator=generator)
    value_cache = torch.randn(num_seqs + 2, kv_heads, capacity, head_dim, generator=generator)
    q = torch.randn(num_seqs, num_nodes, heads, head_dim, generator=generator)
    cache_lens = torch.randint(0, capacity - num_nodes, (num_seqs,), generator=generator).tolist()
    bits = []
    for _ in range(num_seqs):
        real = int(torch.randint(1, num_nodes + 1, (1,), generator=generator))
        parents = [-1] + [int(torch.randint(0, j, (1,), generator=generator))
                          for j in range(1, real)]
        bits.append(tree_bits(parents, num_nodes))
    return (q.to(dtype), key_cache.to(dtype), value_cache.to(dtype), cache_lens, bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128), (4, 4, 32)],
                         ids=["smollm2", "qwen2.5-1.5b", "odd-head-dim"])
@pytest.mark.parametrize("num_seqs,num_nodes", [(1, 1), (3, 1), (2, 7), (1, 64)])
def test_attention_matches_the_float64_reference(path, dtype, shape, num_seqs, num_nodes):
    skip_unless_it_applies(path, dtype)
    heads, kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(num_seqs * 100 + num_nodes)
    q, keys, values, cache_lens, bits = random_case(generator, dtype, heads, kv_heads, head_dim,
                                                    num_seqs, num_nodes)
    scale = head_dim ** -0.5
    out = run_attention(q, keys, values, cache_lens, bits, 1, scale)
    expected = reference_attention(q, keys, values, cache_lens, bits, 1, scale)
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128)], ids=["smollm2", "qwen2.5-1.5b"])
def test_a_querys_result_does_not_depend_on_its_neighbours(path, dtype, shape):
    """The root of a tree gives bit-identical outputs alone, under any tree, padded, and beside
    other rows: what makes speculative decoding token-identical to plain decoding in bf16."""
    skip_unless_it_applies(path, dtype)
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim = shape
    capacity = 200
    keys = torch.randn(4, kv_heads, capacity, head_dim, generator=generator).to(dtype)
    values = torch.randn(4, kv_heads, capacity, head_dim, generator=generator).to(dtype)
    q = torch.randn(4, 33, heads, head_dim, generator=generator).to(dtype)
    cache_len = 150
    alone = run_attention(q[:1, :1].contiguous(), keys, values, [cache_len], [[1]], 0, 0.125)
    chain = tree_bits(list(range(-1, 32)), 33)
    bushy = tree_bits([-1] + [0] * 16, 33)  # 17 real nodes, 16 of padding
    for bits in (chain, bushy):
        out = run_attention(q[:1].contiguous(), keys, values, [cache_len], [bits], 0, 0.125)
        assert torch.equal(out[0, 0], alone[0, 0])
    # Batched: the row in slot 0 beside three others of other lengths.
    out = run_attention(q.contiguous(), keys, values, [cache_len, 3, 166, 90],
                        [chain, bushy, chain, bushy], 0, 0.125)
    assert torch.equal(out[0, 0], alone[0, 0])
    # A chain's node 5 sees exactly what node 0 of a one-node step at cache_len + 5 sees,
    # once the keys of nodes 0-4 are in the cache at those positions.
    out = run_attention(q[:1].contiguous(), keys, values, [cache_len], [chain], 0, 0.125)
    later = run_attention(q[:1, 5:6].contiguous(), keys, values, [cache_len + 5], [[1]], 0,
                          0.125)
    assert torch.equal(out[0, 5], later[0, 0])
    # A bushy tree's node 9 sees the root and itself, 9 positions apart: the same as a one-node
    # step right after the root, its own key and value moved next to the root's.
    out = run_attention(q[:1].contiguous(), keys, values, [cache_len], [bushy], 0, 0.125)
    moved_keys, moved_values = keys.clone(), values.clone()
    moved_keys[0, :, cache_len + 1] = keys[0, :, cache_len + 9]
    moved_values[0, :, cache_len + 1] = values[0, :, cache_len + 9]
    later = run_attention(q[:1, 9:10].contiguous(), moved_keys, moved_values, [cache_len + 1],
                          [[1]], 0, 0.125)
    assert torch.equal(out[0, 9], later[0, 0])


def test_attention_refuses_what_it_cannot_compute():
    q = torch.zeros(1, 65, 2, 64)
    keys = torch.zeros(1, 1, 128, 64)
    lens = torch.zeros(1, dtype=torch.int64)
    bits = torch.zeros(1, 65, dtype=torch.int64)
    out = torch.zeros(1, 65, 128)
    args = (q.data_ptr(), keys.data_ptr(), keys.data_ptr(), lens.data_ptr(), bits.data_ptr(),
            out.data_ptr(), 0)
    with pytest.raises(ValueError, match="1 to 64 nodes"):
        _kernels.attention(*args, 1, 65, 2, 1, 64, 128, 0.125, 0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        _kernels.attention(*args, 1, 1, 3, 2, 64, 128, 0.125, 0)
    lens[0] = 100
    with pytest.raises(ValueError, match="exceed the cache capacity"):
        _kernels.attention(*args, 1, 40, 2, 1, 64, 128, 0.125, 0)
    with pytest.raises(ValueError, match="dtype code"):
        _kernels.rms_norm(q.data_ptr(), q.data_ptr(), q.data_ptr(), 1, 64, 1e-5, 2)


def run_prompt_attention(q, key_cache, value_cache, slot, scale):
    """q [length, heads, head_dim] over the keys at positions [0, length) of `slot`; None where
    the kernel does not apply."""
    length, heads, head_dim = q.shape
    out = torch.full((length, heads * head_dim), float("nan"), dtype=q.dtype)
    done = _kernels.prompt_attention(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                     out.data_ptr(), slot, length, heads, key_cache.shape[1],
                                     head_dim, key_cache.shape[2], scale, CODES[q.dtype])
    return out.view(length, heads, head_dim) if done else None


def causal_reference(q, key_cache, value_cache, slot, scale):
    """float64 causal attention of q [length, heads, head_dim] over the slot's first keys."""
    length, heads, _ = q.shape
    group = heads // key_cache.shape[1]
    keys = key_cache[slot, :, :length].double().repeat_interleave(group, 0)  # [heads, n, d]
    values = value_cache[slot, :, :length].double().repeat_interleave(group, 0)
    scores = torch.einsum("jhd,hpd->hjp", q.double(), keys) * scale
    hidden = torch.ones(length, length, dtype=torch.bool).triu(1)
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("hjp,hpd->jhd", weights, values)


@pytest.fixture(params=["amx", "avx512"])
def prompt_path(request):
    """The prompt kernel's two ways to its scores: the AMX tile unit (bfloat16, where the CPU
    has one) or the AVX-512 vector loop."""
    if not CAN_RUN[request.param]():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    previous = _kernels.set_attention_amx(request.param == "amx")
    yield request.param
    _kernels.set_attention_amx(previous)


@pytest.mark.skipif(not _kernels.has_avx512(), reason="prompt_attention needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(9, 3, 64), (12, 2, 128), (4, 4, 64)],
                         ids=["smollm2", "qwen2.5-1.5b", "no-groups"])
@pytest.mark.parametrize("length", [1, 17, 65, 300])
def test_prompt_attention_matches_the_float64_reference(dtype, shape, length, prompt_path):
    skip_unless_it_applies(prompt_path, dtype)
    heads, kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(length)
    keys = torch.randn(3, kv_heads, 320, head_dim, generator=generator).to(dtype)
    values = torch.randn(3, kv_heads, 320, head_dim, generator=generator).to(dtype)
    q = torch.randn(length, heads, head_dim, generator=generator).to(dtype)
    out = run_prompt_attention(q, keys, values, 2, head_dim ** -0.5)
    expected = causal_reference(q, keys, values, 2, head_dim ** -0.5)
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.skipif(not _kernels.has_avx512(), reason="prompt_attention needs AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_prompt_positions_result_depends_on_its_keys_alone(dtype, prompt_path):
    """Position j gives the same bits in a prompt of any length past j, wherever the work's
    blocks of positions fall: a prompt's KV cache does not depend on how long it is."""
    skip_unless_it_applies(prompt_path, dtype)
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 3, 400, 64, generator=generator).to(dtype)
    values = torch.randn(1, 3, 400, 64, generator=generator).to(dtype)
    q = torch.randn(400, 9, 64, generator=generator).to(dtype)
    full = run_prompt_attention(q, keys, values, 0, 0.125)
    for length in (1, 31, 32, 33, 130, 399):
        part = run_prompt_attention(q[:length].contiguous(), keys, values, 0, 0.125)
        assert torch.equal(part, full[:length])


def test_prompt_attention_declines_or_refuses_what_it_cannot_compute():
    q = torch.zeros(8, 2, 32)
    keys = torch.zeros(1, 1, 16, 32)
    out = torch.zeros(8, 64)
    args = (q.data_ptr(), keys.data_ptr(), keys.data_ptr(), out.data_ptr(), 0)
    assert _kernels.prompt_attention(*args, 8, 2, 1, 32, 16, 0.125, 0) is False  # head_dim 32
    previous = _kernels.set_portable(True)
    try:
        assert _kernels.prompt_attention(*args, 8, 2, 1, 64, 16, 0.125, 0) is False
    finally:
        _kernels.set_portable(previous)
    with pytest.raises(ValueError, match="1 to capacity"):
        _kernels.prompt_attention(*args, 17, 2, 1, 32, 16, 0.125, 0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        _kernels.prompt_attention(*args, 8, 3, 2, 32, 16, 0.125, 0)


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
def test_rope_and_store_rotates_and_writes_the_cache(dtype):
    generator = torch.Generator().manual_seed(3)
    num_seqs, num_nodes, heads, kv_heads, head_dim, capacity = 2, 3, 4, 2, 64, 32
    qkv = torch.randn(num_seqs * num_nodes, (heads + 2 * kv_heads) * head_dim,
                      generator=generator).to(dtype)
    angles = torch.arange(capacity).unsqueeze(1) * 0.1 * torch.arange(1, head_dim + 1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache_lens = torch.tensor([5, 11], dtype=torch.int64)
    positions = torch.tensor([[5, 6, 6], [11, 12, 13]], dtype=torch.int64)  # a tree, a chain
    queries = torch.empty(num_seqs, num_nodes, heads, head_dim, dtype=dtype)
    key_cache = torch.zeros(4, kv_heads, capacity, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    _kernels.rope_and_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                            queries.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                            cache_lens.data_ptr(), 1, num_seqs, num_nodes, heads, kv_heads,
                            head_dim, capacity, CODES[dtype])

    def rotate(x, position):  # transformers' rotate_half form, rounded once per product
        half = head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[position] + rotated * sin[position]

    q, k, v = qkv.view(num_seqs, num_nodes, -1).split(
        (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    tolerance = 1e-6 if dtype == torch.float32 else 1.6e-2
    for s in range(num_seqs):
        for j in range(num_nodes):
            position, slot = int(positions[s, j]), int(cache_lens[s]) + j
            expected_q = rotate(q[s, j].view(heads, head_dim), position)
            assert torch.allclose(queries[s, j].float(), expected_q.float(), atol=tolerance,
                                  rtol=tolerance)
            expected_k = rotate(k[s, j].view(kv_heads, head_dim), position)
            assert torch.allclose(key_cache[1 + s, :, slot].float(), expected_k.float(),
                                  atol=tolerance, rtol=tolerance)
            assert torch.equal(value_cache[1 + s, :, slot], v[s, j].view(kv_heads, head_dim))
    written = key_cache.abs().sum(dim=(1, 3)) > 0  # [slots, capacity]
    assert written.sum().item() == num_seqs * num_nodes  # nothing else touched
    assert not written[0].any() and not written[3].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", [1, 17, 100, 49152, 151936])  # odd tails; both models' rows
@pytest.mark.parametrize("path", ["avx512", "portable"], indirect=True)  # no AVX2 argmax
def test_argmax_gives_torchs_indices(path, dtype, vocab):
    """Greedy verification's token per node: the same index as torch.argmax on every row, ties
    to the first maximum, a NaN counted as the maximum (its first), -0.0 equal to 0.0, and
    bfloat16 logits read as torch reads them."""
    from sssd.common.model.decoder import argmax_last

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
    for case in cases:
        got = argmax_last(case)
        assert got.dtype == torch.int64 and torch.equal(got, case.argmax(-1))
