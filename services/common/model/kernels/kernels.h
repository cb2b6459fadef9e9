// The entry points of sssd._kernels, the CPU operations of the project's forward pass
// (decoder.py): the matrix products, and what runs between them in one call each instead of a
// dozen tensor operations. Which implementation each runs on this CPU: cpu_paths.h.
//
// Tensors are plain row-major arrays of the model's dtype (float32 or bfloat16, `Dtype`); every
// operation computes in float32 and rounds its outputs to the model's dtype where transformers'
// Llama and Qwen2 code would (round to nearest even), so a bfloat16 model computes as it does
// there, up to the order of the sums. Names of dimensions follow the Python side: num_tokens =
// num_seqs * num_nodes rows of a step.
//
// Parallel loops use OpenMP. Loaded after PyTorch, the module shares PyTorch's OpenMP runtime
// (the same libgomp.so.1) and so its threads: a second pool would spin against PyTorch's between
// the calls of a step.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_layout.h"

namespace sssd::kernels {

// The most nodes a row of a step may have in `attention` (its tree is a 64-bit mask per node).
inline constexpr int64_t kMaxTreeNodes = 64;

// OpenMP threads the parallel loops use (PyTorch's setting when the runtime is shared).
int32_t num_threads();

// out[r] = w * round(x[r] * rsqrt(mean(x[r]^2) + eps)): transformers' RMSNorm.
// x, out [rows, dim]; w [dim].
void rms_norm(const void* x, const void* w, void* out, int64_t rows, int64_t dim, float eps,
              Dtype dtype);

// x[r] = round(x[r] + y[r]) (the residual stream, in place), then out[r] = rms_norm(x[r]).
void add_rms_norm(void* x, const void* y, const void* w, void* out, int64_t rows, int64_t dim,
                  float eps, Dtype dtype);

// out[r] = round(round(silu(gate[r])) * up[r]) with gate_up [rows, 2 * inter] = [gate | up];
// out [rows, inter].
void silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, Dtype dtype);

// Rotary embedding and the KV cache write of one layer's step.
//   qkv [num_seqs * num_nodes, (heads + 2 kv_heads) * head_dim]: the fused projection;
//   cos_table, sin_table [table_len, head_dim]: the rotary tables by position (rows.position_ids
//   < table_len); q_out [num_seqs, num_nodes, heads, head_dim]: the rotated queries. Token j of
//   row s is written at cache position rows.cache_lens[s] + j of its blocks (kv_layout.h). Keys
//   are rotated, values copied.
void rope_and_store(const KvLayout& cache, int64_t layer, const StepRows& rows, const void* qkv,
                    const void* cos_table, const void* sin_table, void* q_out, int64_t heads);

// Tree attention of the step's queries over the cache.
//   q [num_seqs, num_nodes, heads, head_dim] (rope_and_store's q_out);
//   rows.tree_bits: who sees whom among the step's nodes; every node sees its row's
//   rows.cache_lens[s] cached positions;
//   out [num_seqs, num_nodes, heads * head_dim].
// Query head h reads key head h / (heads / kv_heads). Softmax in float32. The sums over keys run
// in position order over the visible keys only (on the AVX-512 and AVX2 paths in segments of a
// query's visible keys cut by rank, merged in order: attention.cc), so a query's result depends
// on what it sees, not on the batch, the threads, the tree's shape, its padding or the blocks
// that hold the keys. A prompt (or
// a chunk of one) is a chain: in rows of up to kMaxTreeNodes tokens, each seeing the row's cached
// positions and its own tokens before it, so a position's keys and values come out the same
// bits whether it was prefilled or decoded.
void attention(const KvLayout& cache, int64_t layer, const StepRows& rows, const void* q,
               void* out, int64_t heads, float scale);

// out[r] = the index of the first maximum of row r of x [rows, cols], as torch.argmax: a NaN
// counts as the maximum (the row's first NaN), -0.0 equals 0.0. Greedy verification's token per
// node; torch's argmax over bfloat16 logits scans a row without vectorizing, a visible part of a
// small model's step with many nodes (bench/results/2026-11-27).
void argmax_rows(const void* x, int64_t rows, int64_t cols, Dtype dtype, int64_t* out);

// The KV cache's commit in one call: moves cache position sources[i] to targets[i] in every
// layer's keys and values, every head. A position is a slot of the whole cache, block *
// block_size + offset. All sources are read before any target is written, as an indexed copy
// gathers its right-hand side first, so moves may overlap. Throws std::out_of_range, having
// moved nothing, for a position outside the cache.
void move_positions(const KvLayout& cache, const std::vector<int64_t>& sources,
                    const std::vector<int64_t>& targets);

// The panels of linear_bf16's packed weights for `out_features` outputs (64 outputs a panel).
int64_t packed_bf16_panels(int64_t out_features);

// out = round(x W^T (+ bias)) in bfloat16, the sums in float32 (linear_panels.cc).
//   x [rows, in_features], in_features even; out [rows, out_features]; bias [out_features] or
//   null; packed: W [out_features, in_features] as packed_bf16_panels(out_features) panels of
//   [in_features / 2][64][2] (output n = 64 p + i, inputs (2 t, 2 t + 1) at [p][t][i][0..1]),
//   the last panel's missing outputs zero. A row's result does not depend on the other rows.
void linear_bf16(const void* x, const void* packed, const void* bias, void* out, int64_t rows,
                 int64_t in_features, int64_t out_features);

// Each sums[j] (+ bias[j]) rounded to bfloat16 to nearest even, into out[j], j < width; bias
// null or bfloat16 (linear_panels.cc; the last step of linear_bf16 and linear_bf16_amx).
void round_sums_bf16(const float* sums, const uint16_t* bias, uint16_t* out, int64_t width);

// True when this CPU has AMX's bfloat16 tiles and the OS lets this process use them (asked
// here, once); linear_bf16_amx runs there only.
bool has_amx_bf16();

// linear_bf16's product (same arguments, same packed panels) on the AMX tile unit
// (linear_amx.cc); in_features a multiple of 32. A row's result does not depend on the other
// rows; it may differ from linear_bf16's in the last bit, where the tile unit orders a sum
// differently.
void linear_bf16_amx(const void* x, const void* packed, const void* bias, void* out,
                     int64_t rows, int64_t in_features, int64_t out_features);

// How far ahead of its loads the AMX products' first row group asks for cache lines, into L1.
// (The AVX-512 panels and read_bytes ask into L2 from farther ahead, linear_panels.cc; asking
// so for the AMX products measured no different.) The hardware prefetcher alone kept the median
// step but not its slow tail while other tenants loaded the machine.
constexpr int64_t kPrefetchAhead = 2048;

// Reads num_bytes (a multiple of 64) of `data` once, as the panels read their weights (the
// threads splitting them, 64-byte vectors, prefetched as they are), and returns their
// bits OR-ed together: the benchmarks' bandwidth probe. AVX-512 only, like linear_f32
// (read_bytes_avx2 elsewhere; cpu_paths.h's panels path chooses).
uint64_t read_bytes(const void* data, int64_t num_bytes);

// out = x W^T (+ bias) in float32, one fused multiply-add per input in order, the bias added
// last. packed: W as packed_bf16_panels(out_features) panels of [in_features][64] float32
// (output n = 64 p + i, input k at [p][k][i]), the last panel's missing outputs zero. A row's
// result does not depend on the other rows.
void linear_f32(const float* x, const float* packed, const float* bias, float* out,
                int64_t rows, int64_t in_features, int64_t out_features);

// linear_bf16, linear_f32 and read_bytes for CPUs without AVX-512 (linear_panels_avx2.cc): the
// same arguments and packed panels, a row's result independent of the other rows; a product may
// differ from the AVX-512 build's in the last bit (the order within a pair of inputs).
void linear_bf16_avx2(const void* x, const void* packed, const void* bias, void* out,
                      int64_t rows, int64_t in_features, int64_t out_features);
void linear_f32_avx2(const float* x, const float* packed, const float* bias, float* out,
                     int64_t rows, int64_t in_features, int64_t out_features);
uint64_t read_bytes_avx2(const void* data, int64_t num_bytes);

}  // namespace sssd::kernels
