#include "fused_ops.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "numbers.h"

#if defined(__x86_64__) && defined(__GNUC__)
// One copy of each hot loop for AVX-512, one for AVX2 and one for any x86-64, chosen at load
// time by the CPU (a machine runs one of them throughout). The AVX2 copy rounds as the portable
// one (its target has no FMA to contract a multiply and an add into); the AVX-512 one may
// contract them.
#define SSSD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SSSD_CLONES
#endif

namespace sssd::kernels {
namespace {

using detail::AttentionProblem;
using detail::bf16_to_float;
using detail::exp_nonpositive;
using detail::float_to_bf16;
using detail::round_to;

// Rows run on the calling thread while they hold fewer values than this in all: a parallel
// region (a few microseconds) then costs more than their work saves. A step of 16 nodes of a
// 1.5B model (rows of 1,536 and 8,960 values) is split between the threads; a single row is
// never split, so a row's values never depend on the rows beside it.
constexpr int64_t kParallelValues = 16384;

bool worth_threads(int64_t rows, int64_t width) {
  return rows > 1 && rows * width >= kParallelValues;
}

std::atomic<bool> portable{false};
std::atomic<bool> attention_avx2{false};  // set_attention_avx2
std::atomic<bool> attention_amx{true};     // set_attention_amx
std::atomic<bool> attention_dpbf16{true};  // set_attention_dpbf16

// The AVX-512 attention (trees and prompts) takes its scores on the AMX tile unit.
bool amx_scores(Dtype dtype) {
  return attention_amx.load() && dtype == Dtype::kBFloat16 && has_amx_bf16();
}

// Row [count] of `base` at `offset`, as float32, into out.
SSSD_CLONES void to_float(const void* base, int64_t offset, int64_t count, Dtype dtype,
                          float* out) {
  if (dtype == Dtype::kFloat32) {
    std::memcpy(out, static_cast<const float*>(base) + offset, count * sizeof(float));
    return;
  }
  const uint16_t* in = static_cast<const uint16_t*>(base) + offset;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t wide = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &wide, sizeof(float));
  }
}

SSSD_CLONES void from_float(const float* in, int64_t count, Dtype dtype, void* base,
                            int64_t offset) {
  if (dtype == Dtype::kFloat32) {
    std::memcpy(static_cast<float*>(base) + offset, in, count * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(base) + offset;
  for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(in[i]);
}

// q . k over n values, in kDotLanes partial sums (element d into sum d % kDotLanes, the sums
// then added in order): a loop the compiler vectorizes, which a single running sum is not
// without -ffast-math.
constexpr int64_t kDotLanes = 8;

SSSD_CLONES float dot(const float* q, const float* k, int64_t n) {
  float lanes[kDotLanes] = {};
  const int64_t body = n - n % kDotLanes;
  for (int64_t d = 0; d < body; d += kDotLanes) {
    for (int64_t l = 0; l < kDotLanes; ++l) lanes[l] += q[d + l] * k[d + l];
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kDotLanes; ++l) sum += lanes[l];
  for (int64_t d = body; d < n; ++d) sum += q[d] * k[d];
  return sum;
}

// --- layer pieces ------------------------------------------------------------------------------

SSSD_CLONES void norm_row(const float* x, const float* w, float* out, int64_t dim, float eps,
                          Dtype dtype) {
  // The squares summed in kDotLanes partial sums, which vectorizes; a single running sum is a
  // chain of dependent additions, 2.5 us a row of 1,536 (half of a layer's norms at 16 rows).
  const float sum = dot(x, x, dim);
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = w[i] * round_to(x[i] * inverse, dtype);
}

SSSD_CLONES void add_rows(float* x, const float* y, int64_t dim, Dtype dtype) {
  for (int64_t i = 0; i < dim; ++i) x[i] = round_to(x[i] + y[i], dtype);
}

SSSD_CLONES void silu_mul_row(const float* gate, const float* up, float* out, int64_t inter,
                              Dtype dtype) {
  for (int64_t i = 0; i < inter; ++i) {
    const float g = gate[i];
    // silu(g) = g * sigmoid(g); exp of a non-positive argument either way.
    const float e = exp_nonpositive(-std::fabs(g));
    // 1 / (1 + e) or e / (1 + e): one division whose numerator is chosen, which vectorizes
    // (a choice between two divisions stays a branch: the compiler may not run a division the
    // source did not, as it could raise a floating-point exception).
    const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
    out[i] = round_to(round_to(g * sigmoid, dtype) * up[i], dtype);
  }
}

// Rotates x [head_dim] (halves swapped) by cos, sin, as transformers does in the model dtype:
// round(round(x * cos) + round(rotated * sin)).
SSSD_CLONES void rotate_row(const float* x, const float* cos, const float* sin, float* out,
                            int64_t head_dim, Dtype dtype) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < head_dim; ++i) {
    const float rotated = i < half ? -x[i + half] : x[i - half];
    out[i] = round_to(round_to(x[i] * cos[i], dtype) + round_to(rotated * sin[i], dtype), dtype);
  }
}

// y += a x over n values.
SSSD_CLONES void add_scaled(float* y, float a, const float* x, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

// The portable attention of one (row, key head) pair, for CPUs without AVX-512 or AVX2: for each
// query (node j, query head k of the group), the same sums in the same order as the AVX-512 one
// (attention_avx512.cc) up to the order within a dot product: scores over the visible keys,
// their maximum, then the weights and the weighted values added in key order. Each key and
// value is widened to float32 once for all the group's queries and nodes that see it.
void attend_portable(const AttentionProblem& problem, int64_t s, int64_t g) {
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t head_dim = problem.head_dim;
  const int64_t length = problem.cache_lens[s] + num_nodes;
  const int64_t offset = problem.cache_offset(s, g);
  const int64_t queries = num_nodes * group;  // query i: node i / group, head g * group + i % group
  std::vector<float> query(queries * head_dim), row(head_dim), scores(queries * length),
      top(queries, -INFINITY), total(queries, 0.0f), result(queries * head_dim, 0.0f);
  const auto q_offset = [&](int64_t i) {
    return ((s * num_nodes + i / group) * problem.heads + g * group + i % group) * head_dim;
  };
  for (int64_t i = 0; i < queries; ++i) {
    to_float(problem.q, q_offset(i), head_dim, problem.dtype, query.data() + i * head_dim);
  }
  for (int64_t p = 0; p < length; ++p) {
    bool widened = false;
    for (int64_t j = 0; j < num_nodes; ++j) {
      const bool visible = problem.visible(s, j, p);
      if (visible && !widened) {
        to_float(problem.key_cache, offset + p * head_dim, head_dim, problem.dtype, row.data());
        widened = true;
      }
      for (int64_t i = j * group; i < (j + 1) * group; ++i) {
        float& score = scores[i * length + p];
        score = visible ? dot(query.data() + i * head_dim, row.data(), head_dim) * problem.scale
                        : -INFINITY;
        top[i] = std::max(top[i], score);
      }
    }
  }
  for (int64_t p = 0; p < length; ++p) {
    bool widened = false;
    for (int64_t i = 0; i < queries; ++i) {
      const float weight = exp_nonpositive(scores[i * length + p] - top[i]);
      if (weight == 0.0f) continue;
      if (!widened) {
        to_float(problem.value_cache, offset + p * head_dim, head_dim, problem.dtype,
                 row.data());
        widened = true;
      }
      total[i] += weight;
      add_scaled(result.data() + i * head_dim, weight, row.data(), head_dim);
    }
  }
  for (int64_t i = 0; i < queries; ++i) {
    float* out = result.data() + i * head_dim;
    const float inverse = 1.0f / total[i];
    for (int64_t d = 0; d < head_dim; ++d) out[d] *= inverse;
    from_float(out, head_dim, problem.dtype, problem.out, q_offset(i));
  }
}

}  // namespace

bool has_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

bool set_portable(bool value) { return portable.exchange(value); }

bool set_attention_avx2(bool value) { return attention_avx2.exchange(value); }

bool set_attention_amx(bool value) { return attention_amx.exchange(value); }

bool set_attention_dpbf16(bool value) { return attention_dpbf16.exchange(value); }

int32_t num_threads() { return omp_get_max_threads(); }

void rms_norm(const void* x, const void* w, void* out, int64_t rows, int64_t dim, float eps,
              Dtype dtype) {
  std::vector<float> ws(dim);
  to_float(w, 0, dim, dtype, ws.data());
#pragma omp parallel if (worth_threads(rows, dim))
  {
    std::vector<float> xs(dim), result(dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      to_float(x, r * dim, dim, dtype, xs.data());
      norm_row(xs.data(), ws.data(), result.data(), dim, eps, dtype);
      from_float(result.data(), dim, dtype, out, r * dim);
    }
  }
}

void add_rms_norm(void* x, const void* y, const void* w, void* out, int64_t rows, int64_t dim,
                  float eps, Dtype dtype) {
  std::vector<float> ws(dim);
  to_float(w, 0, dim, dtype, ws.data());
#pragma omp parallel if (worth_threads(rows, dim))
  {
    std::vector<float> xs(dim), ys(dim), result(dim);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      to_float(x, r * dim, dim, dtype, xs.data());
      to_float(y, r * dim, dim, dtype, ys.data());
      add_rows(xs.data(), ys.data(), dim, dtype);
      from_float(xs.data(), dim, dtype, x, r * dim);
      norm_row(xs.data(), ws.data(), result.data(), dim, eps, dtype);
      from_float(result.data(), dim, dtype, out, r * dim);
    }
  }
}

void silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, Dtype dtype) {
#pragma omp parallel if (worth_threads(rows, 2 * inter))
  {
    std::vector<float> gate(inter), up(inter), result(inter);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      to_float(gate_up, r * 2 * inter, inter, dtype, gate.data());
      to_float(gate_up, r * 2 * inter + inter, inter, dtype, up.data());
      silu_mul_row(gate.data(), up.data(), result.data(), inter, dtype);
      from_float(result.data(), inter, dtype, out, r * inter);
    }
  }
}

void rope_and_store(const void* qkv, const void* cos_table, const void* sin_table,
                    const int64_t* position_ids, void* q_out, void* key_cache, void* value_cache,
                    const int64_t* cache_lens, int64_t first_slot, int64_t num_seqs,
                    int64_t num_nodes, int64_t heads, int64_t kv_heads, int64_t head_dim,
                    int64_t capacity, Dtype dtype) {
  const int64_t width = (heads + 2 * kv_heads) * head_dim;
  const int64_t num_tokens = num_seqs * num_nodes;
#pragma omp parallel if (worth_threads(num_tokens, width))
  {
    std::vector<float> cs(head_dim), sn(head_dim), x(head_dim), rotated(head_dim);
#pragma omp for schedule(static)
    for (int64_t token = 0; token < num_tokens; ++token) {
      const int64_t s = token / num_nodes, j = token % num_nodes;
      to_float(cos_table, position_ids[token] * head_dim, head_dim, dtype, cs.data());
      to_float(sin_table, position_ids[token] * head_dim, head_dim, dtype, sn.data());
      const int64_t row = token * width;
      for (int64_t h = 0; h < heads; ++h) {
        to_float(qkv, row + h * head_dim, head_dim, dtype, x.data());
        rotate_row(x.data(), cs.data(), sn.data(), rotated.data(), head_dim, dtype);
        from_float(rotated.data(), head_dim, dtype, q_out, (token * heads + h) * head_dim);
      }
      const int64_t position = cache_lens[s] + j;
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t cached = (((first_slot + s) * kv_heads + g) * capacity + position) *
                               head_dim;
        to_float(qkv, row + (heads + g) * head_dim, head_dim, dtype, x.data());
        rotate_row(x.data(), cs.data(), sn.data(), rotated.data(), head_dim, dtype);
        from_float(rotated.data(), head_dim, dtype, key_cache, cached);
        to_float(qkv, row + (heads + kv_heads + g) * head_dim, head_dim, dtype, x.data());
        from_float(x.data(), head_dim, dtype, value_cache, cached);
      }
    }
  }
}

namespace {

constexpr int64_t kLanes = 16;       // one AVX-512 vector of float32
constexpr int64_t kScanBlock = 64;   // values tested at once for the first maximum

// Element i of a row of `dtype` as float32.
inline float value_at(const void* row, int64_t i, Dtype dtype) {
  return dtype == Dtype::kFloat32 ? static_cast<const float*>(row)[i]
                                  : bf16_to_float(static_cast<const uint16_t*>(row)[i]);
}

// The row's largest value, or NaN when it holds one. Lane by lane, so that the loop vectorizes
// (a max reduction over floats does not without -ffast-math).
template <Dtype kDtype>
SSSD_CLONES float row_max(const void* row, int64_t cols) {
  float lane_max[kLanes];
  int32_t lane_nan[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) lane_max[k] = -INFINITY, lane_nan[k] = 0;
  const int64_t body = cols - cols % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) {
      const float v = value_at(row, i + k, kDtype);
      lane_max[k] = v > lane_max[k] ? v : lane_max[k];
      lane_nan[k] |= v != v;
    }
  }
  float best = -INFINITY;
  int32_t nan = 0;
  for (int64_t k = 0; k < kLanes; ++k) best = std::max(best, lane_max[k]), nan |= lane_nan[k];
  for (int64_t i = body; i < cols; ++i) {
    const float v = value_at(row, i, kDtype);
    best = v > best ? v : best;
    nan |= v != v;
  }
  return nan ? NAN : best;
}

// The first index whose value equals `target` (is NaN, for a NaN target); blocks that hold none
// are skipped with one vectorized test each.
template <Dtype kDtype>
SSSD_CLONES int64_t first_equal(const void* row, int64_t cols, float target) {
  const bool nan = target != target;
  int64_t start = 0;
  for (; start + kScanBlock <= cols; start += kScanBlock) {
    int32_t any = 0;
    for (int64_t k = 0; k < kScanBlock; ++k) {
      const float v = value_at(row, start + k, kDtype);
      any |= nan ? v != v : v == target;
    }
    if (any) break;
  }
  for (int64_t i = start; i < cols; ++i) {
    const float v = value_at(row, i, kDtype);
    if (nan ? v != v : v == target) return i;
  }
  return cols - 1;  // not reached: the target is one of the row's values
}

template <Dtype kDtype>
int64_t argmax_row(const void* row, int64_t cols) {
  return first_equal<kDtype>(row, cols, row_max<kDtype>(row, cols));
}

}  // namespace

void argmax_rows(const void* x, int64_t rows, int64_t cols, Dtype dtype, int64_t* out) {
  if (cols <= 0) throw std::invalid_argument("argmax_rows needs at least one column");
  const bool vector = !portable.load() && has_avx512();
  const size_t bytes = dtype == Dtype::kFloat32 ? sizeof(float) : sizeof(uint16_t);
  // A row of a vocabulary's logits is worth a thread of its own.
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const void* row = static_cast<const char*>(x) + static_cast<size_t>(r * cols) * bytes;
    if (vector) {
      out[r] = detail::argmax_avx512(row, cols, dtype);
    } else {
      out[r] = dtype == Dtype::kFloat32 ? argmax_row<Dtype::kFloat32>(row, cols)
                                        : argmax_row<Dtype::kBFloat16>(row, cols);
    }
  }
}

void move_positions(const std::vector<uintptr_t>& buffers, int64_t num_heads, int64_t capacity,
                    int64_t position_bytes, const std::vector<int64_t>& rows,
                    const std::vector<int64_t>& sources, const std::vector<int64_t>& targets) {
  const size_t num_moves = rows.size();
  const size_t bytes = static_cast<size_t>(position_bytes);
  std::vector<char> gathered(num_moves * num_heads * bytes);
  auto at = [&](char* base, int64_t row, int64_t head, int64_t position) {
    return base + ((row * num_heads + head) * capacity + position) * position_bytes;
  };
  for (const uintptr_t buffer : buffers) {
    char* base = reinterpret_cast<char*>(buffer);
    char* slot = gathered.data();
    for (size_t i = 0; i < num_moves; ++i) {
      for (int64_t head = 0; head < num_heads; ++head, slot += bytes) {
        std::memcpy(slot, at(base, rows[i], head, sources[i]), bytes);
      }
    }
    slot = gathered.data();
    for (size_t i = 0; i < num_moves; ++i) {
      for (int64_t head = 0; head < num_heads; ++head, slot += bytes) {
        std::memcpy(at(base, rows[i], head, targets[i]), slot, bytes);
      }
    }
  }
}

void attention(const void* q, const void* key_cache, const void* value_cache,
               const int64_t* cache_lens, const uint64_t* tree_bits, void* out,
               int64_t first_slot, int64_t num_seqs, int64_t num_nodes, int64_t heads,
               int64_t kv_heads, int64_t head_dim, int64_t capacity, float scale, Dtype dtype) {
  if (num_nodes < 1 || num_nodes > kMaxTreeNodes) {
    throw std::invalid_argument("attention: 1 to 64 nodes per row");
  }
  if (kv_heads < 1 || heads % kv_heads != 0 || head_dim % 2 != 0) {
    throw std::invalid_argument("attention: heads must be a multiple of kv_heads");
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (cache_lens[s] < 0 || cache_lens[s] + num_nodes > capacity) {
      throw std::invalid_argument("attention: a row's keys exceed the cache capacity");
    }
  }
  AttentionProblem problem{q,     key_cache, value_cache, cache_lens, tree_bits, out,
                           first_slot, num_seqs, num_nodes, heads, kv_heads, head_dim,
                           capacity, scale, dtype};
  const bool vector = !portable.load() && !attention_avx2.load() && has_avx512();
  problem.amx = vector && amx_scores(dtype);
  problem.dpbf16 = vector && !problem.amx && attention_dpbf16.load() &&
                   dtype == Dtype::kBFloat16 && has_avx512_bf16();
  const bool avx2 = !portable.load() && !vector && has_avx2_fma();
  const int64_t items = num_seqs * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t s = item / kv_heads, g = item % kv_heads;
    if (vector && detail::attend_avx512(problem, s, g)) continue;
    if (avx2 && detail::attend_avx2(problem, s, g)) continue;
    attend_portable(problem, s, g);
  }
}

bool prompt_attention(const void* q, const void* key_cache, const void* value_cache, void* out,
                      int64_t slot, int64_t length, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t capacity, float scale, Dtype dtype) {
  if (length < 1 || length > capacity || slot < 0) {
    throw std::invalid_argument("prompt_attention: 1 to capacity positions, a slot >= 0");
  }
  if (kv_heads < 1 || heads % kv_heads != 0) {
    throw std::invalid_argument("prompt_attention: heads must be a multiple of kv_heads");
  }
  if (portable.load() || !has_avx512()) return false;
  AttentionProblem problem{q,        key_cache, value_cache, nullptr,  nullptr, out,
                           slot,     1,         length,      heads,    kv_heads, head_dim,
                           capacity, scale,     dtype};
  problem.amx = amx_scores(dtype);
  return detail::prompt_attention_avx512(problem);
}

}  // namespace sssd::kernels
