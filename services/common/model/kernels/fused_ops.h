// Fused operations of one decoder layer, for the verifier's CPU forward pass (decoder.py): what
// runs between the matrix products, in one call each instead of a dozen tensor operations.
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

namespace sssd::kernels {

enum class Dtype : int32_t { kFloat32 = 0, kBFloat16 = 1 };

// The most nodes a row of a step may have in `attention` (its tree is a 64-bit mask per node).
inline constexpr int64_t kMaxTreeNodes = 64;

// True when this CPU runs the AVX-512 paths (else portable loops, same results up to rounding).
bool has_avx512();

// Turns the vector attention (AVX-512, else AVX2) and the AVX-512 argmax off (tests compare the
// paths); returns the previous setting.
bool set_portable(bool portable);

// Runs the AVX2 attention even where the CPU has AVX-512 (True; tests run it on every CPU that
// has AVX2) or lets the CPU choose again; returns the previous setting.
bool set_attention_avx2(bool avx2);

// Lets the AVX-512 tree attention take its scores on the AMX tile unit where the CPU has one
// and the dtype is bfloat16 (True, the default) or not (tests compare the two); returns the
// previous setting.
bool set_attention_amx(bool amx);

// Lets the AVX-512 tree attention take its bfloat16 scores with AVX-512 BF16's dot products
// where the CPU has them and the tile unit does not take them (True, the default) or not;
// returns the previous setting.
bool set_attention_dpbf16(bool dpbf16);

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
//   cos_table, sin_table [table_len, head_dim]: the rotary tables by position;
//   position_ids [num_seqs * num_nodes] int64: each token's position (< table_len);
//   q_out [num_seqs, num_nodes, heads, head_dim]: the rotated queries;
//   key_cache, value_cache [max_seqs, kv_heads, capacity, head_dim]: one layer's cache, whose
//   slots first_slot + s hold the step's rows; cache_lens [num_seqs] int64: the tokens already
//   in each row's slot; token j of row s is written at cache position cache_lens[s] + j.
// Keys are rotated, values copied.
void rope_and_store(const void* qkv, const void* cos_table, const void* sin_table,
                    const int64_t* position_ids, void* q_out, void* key_cache, void* value_cache,
                    const int64_t* cache_lens, int64_t first_slot, int64_t num_seqs,
                    int64_t num_nodes, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t capacity, Dtype dtype);

// Tree attention of the step's queries over the cache.
//   q [num_seqs, num_nodes, heads, head_dim] (rope_and_store's q_out);
//   cache_lens [num_seqs]: as for rope_and_store; the step's nodes follow them in the cache;
//   tree_bits [num_seqs, num_nodes]: bit a of node j set when node j sees node a (itself and
//   its ancestors); every node sees its row's cache_lens[s] cached positions;
//   out [num_seqs, num_nodes, heads * head_dim].
// Query head h reads key head h / (heads / kv_heads). Softmax in float32. The sums over keys run
// in position order over the visible keys only, so a query's result depends on what it sees,
// not on the batch, the tree's shape or its padding.
void attention(const void* q, const void* key_cache, const void* value_cache,
               const int64_t* cache_lens, const uint64_t* tree_bits, void* out,
               int64_t first_slot, int64_t num_seqs, int64_t num_nodes, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t capacity, float scale, Dtype dtype);

// Causal attention of a prompt over its own keys, written at cache positions [0, length) of
// `slot` (rope_and_store's keys and values): query position j sees keys 0..j.
//   q [length, heads, head_dim] (rope_and_store's q_out); out [length, heads * head_dim].
// Softmax and every sum in float32, over each query's keys in position order, so a query's
// result depends on the prompt alone. The work is tiled (blocks of queries of a key head against
// keys transposed once per call) where PyTorch's flash kernel for the CPU computes tile by tile
// at a fraction of the machine's multiply rate (SmolLM2, 1,024 tokens: 10.6 ms a layer).
// Returns false, having done nothing, where it does not apply (no AVX-512, the portable paths
// set, head_dim other than 64 or 128): the caller then attends by other means.
bool prompt_attention(const void* q, const void* key_cache, const void* value_cache, void* out,
                      int64_t slot, int64_t length, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t capacity, float scale, Dtype dtype);

// out[r] = the index of the first maximum of row r of x [rows, cols], as torch.argmax: a NaN
// counts as the maximum (the row's first NaN), -0.0 equals 0.0. Greedy verification's token per
// node; torch's argmax over bfloat16 logits scans a row without vectorizing (1.1 ms for 8 rows of
// SmolLM2's 49152 logits on the AMX Xeon, 16 ms for 128 rows, against a 23 ms decode step).
void argmax_rows(const void* x, int64_t rows, int64_t cols, Dtype dtype, int64_t* out);

// The KV cache's commit in one call: in each of `buffers` (every layer's keys and values, each
// [max_seqs][num_heads][capacity] positions of position_bytes), moves position sources[i] of
// slot rows[i] to targets[i], every head. All sources are read before any target is written,
// as an indexed copy gathers its right-hand side first, so moves may overlap.
void move_positions(const std::vector<uintptr_t>& buffers, int64_t num_heads, int64_t capacity,
                    int64_t position_bytes, const std::vector<int64_t>& rows,
                    const std::vector<int64_t>& sources, const std::vector<int64_t>& targets);

// True when this CPU has AVX-512 with its bfloat16 instructions (linear_bf16's AVX-512 build
// runs there only; elsewhere the bindings call linear_bf16_avx2).
bool has_avx512_bf16();

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
// so for the AMX products measured no different.) The hardware prefetcher alone kept a 1-row
// Qwen2.5-Coder-1.5B step's AMX products at 121 ms median, but at 206 ms in its slowest tenth
// while other tenants loaded the machine; asking 2 KB ahead, 122 and 159 (bench/linear_panels.py,
// taking turns in one process).
constexpr int64_t kPrefetchAhead = 2048;

// Reads num_bytes (a multiple of 64) of `data` once, as the panels read their weights (the
// threads splitting them, 64-byte vectors, prefetched as they are), and returns their
// bits OR-ed together: the benchmarks' bandwidth probe. AVX-512 only, like linear_f32
// (read_bytes_avx2 elsewhere).
uint64_t read_bytes(const void* data, int64_t num_bytes);

// True when this CPU has AVX-512 (linear_f32 runs there only; elsewhere linear_f32_avx2).
bool has_avx512_fma();

// out = x W^T (+ bias) in float32, one fused multiply-add per input in order, the bias added
// last. packed: W as packed_bf16_panels(out_features) panels of [in_features][64] float32
// (output n = 64 p + i, input k at [p][k][i]), the last panel's missing outputs zero. A row's
// result does not depend on the other rows.
void linear_f32(const float* x, const float* packed, const float* bias, float* out,
                int64_t rows, int64_t in_features, int64_t out_features);

// True when this CPU has AVX2 and FMA (the _avx2 products below run there only).
bool has_avx2_fma();

// linear_bf16, linear_f32 and read_bytes for CPUs without AVX-512 (linear_panels_avx2.cc): the
// same arguments and packed panels, a row's result independent of the other rows; a product may
// differ from the AVX-512 build's in the last bit (the order within a pair of inputs).
void linear_bf16_avx2(const void* x, const void* packed, const void* bias, void* out,
                      int64_t rows, int64_t in_features, int64_t out_features);
void linear_f32_avx2(const float* x, const float* packed, const float* bias, float* out,
                     int64_t rows, int64_t in_features, int64_t out_features);
uint64_t read_bytes_avx2(const void* data, int64_t num_bytes);

}  // namespace sssd::kernels
