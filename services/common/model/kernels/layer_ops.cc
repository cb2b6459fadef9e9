// The operations of a decoder layer between its matrix products: RMSNorm (with the residual
// add), SiLU and product, and the rotary embedding with the KV cache's write. Each computes in
// float32 and rounds its outputs to the model's dtype where transformers' Llama and Qwen2 code
// would, so a bfloat16 model computes as it does there up to the order of the sums; a row's
// values never depend on the rows beside it (a row is never split between threads).
#include <omp.h>

#include <cmath>
#include <vector>

#include "kernels.h"
#include "rows.h"

namespace sssd::kernels {
namespace {

using detail::dot;
using detail::exp_nonpositive;
using detail::from_float;
using detail::round_to;
using detail::to_float;
using detail::worth_threads;

SSSD_CLONES void norm_row(const float* x, const float* w, float* out, int64_t dim, float eps,
                          Dtype dtype) {
  // The squares summed in kDotLanes partial sums, which vectorizes; a single running sum is a
  // chain of dependent additions, half of a layer's norms at 16 rows.
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

}  // namespace

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

void rope_and_store(const KvLayout& cache, int64_t layer, const StepRows& rows, const void* qkv,
                    const void* cos_table, const void* sin_table, void* q_out, int64_t heads) {
  const int64_t kv_heads = cache.kv_heads, head_dim = cache.head_dim;
  const int64_t num_seqs = rows.num_seqs, num_nodes = rows.num_nodes;
  const Dtype dtype = cache.dtype;
  void* const key_cache = reinterpret_cast<void*>(cache.keys[layer]);
  void* const value_cache = reinterpret_cast<void*>(cache.values[layer]);
  const int64_t width = (heads + 2 * kv_heads) * head_dim;
  const int64_t num_tokens = num_seqs * num_nodes;
#pragma omp parallel if (worth_threads(num_tokens, width))
  {
    std::vector<float> cs(head_dim), sn(head_dim), x(head_dim), rotated(head_dim);
#pragma omp for schedule(static)
    for (int64_t token = 0; token < num_tokens; ++token) {
      const int64_t s = token / num_nodes, j = token % num_nodes;
      to_float(cos_table, rows.position_ids[token] * head_dim, head_dim, dtype, cs.data());
      to_float(sin_table, rows.position_ids[token] * head_dim, head_dim, dtype, sn.data());
      const int64_t row = token * width;
      for (int64_t h = 0; h < heads; ++h) {
        to_float(qkv, row + h * head_dim, head_dim, dtype, x.data());
        rotate_row(x.data(), cs.data(), sn.data(), rotated.data(), head_dim, dtype);
        from_float(rotated.data(), head_dim, dtype, q_out, (token * heads + h) * head_dim);
      }
      const int64_t position = rows.cache_lens[s] + j;
      const int64_t block = rows.block_tables[s * rows.max_blocks + position / cache.block_size];
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t cached =
            ((block * kv_heads + g) * cache.block_size + position % cache.block_size) * head_dim;
        to_float(qkv, row + (heads + g) * head_dim, head_dim, dtype, x.data());
        rotate_row(x.data(), cs.data(), sn.data(), rotated.data(), head_dim, dtype);
        from_float(rotated.data(), head_dim, dtype, key_cache, cached);
        to_float(qkv, row + (heads + kv_heads + g) * head_dim, head_dim, dtype, x.data());
        from_float(x.data(), head_dim, dtype, value_cache, cached);
      }
    }
  }
}

}  // namespace sssd::kernels
