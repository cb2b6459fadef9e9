// Number formats shared by the portable kernels and the vector ones, and the entry points of
// the attention paths (tree_attention_avx512.cc, attention_avx2.cc).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "kv_layout.h"

namespace sssd::kernels::detail {
// The conversions in an unnamed namespace: files compiled for different instruction sets include
// them, and each keeps its own copy (panels_loop.h says why).
namespace {

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// Round to nearest even, as PyTorch converts float32 to bfloat16.
// Without a branch (a NaN chosen, not returned early), so that loops over it vectorize.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// values [count] float32 into base + offset (elements) of the model's dtype: an attention
// output row.
inline void store_row(const float* values, int64_t count, Dtype dtype, void* base,
                      int64_t offset) {
  if (dtype == Dtype::kFloat32) {
    std::memcpy(static_cast<float*>(base) + offset, values, count * sizeof(float));
  } else {
    uint16_t* out = static_cast<uint16_t*>(base) + offset;
    for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(values[i]);
  }
}

// A value rounded to the model's dtype and back: what a tensor of that dtype would hold.
inline float round_to(float value, Dtype dtype) {
  return dtype == Dtype::kFloat32 ? value : bf16_to_float(float_to_bf16(value));
}

// exp(x) for x <= 0 (softmax after subtracting the maximum): 2^(x log2 e) split into an integer
// power, set in the exponent bits, and a polynomial on [-0.5, 0.5]; relative error ~2e-7. Plain
// arithmetic, so the compiler vectorizes it. Below -87 (and for -inf: a masked key) it is 0.
inline float exp_nonpositive(float x) {
  const bool vanishes = x < -87.0f;
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  // Round to the nearest integer by adding and subtracting 1.5 * 2^23 (|t| < 2^22): plain
  // arithmetic, which vectorizes, where std::nearbyint would be a library call per element.
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float f = t - n;  // [-0.5, 0.5]
  // 2^f by its Taylor series in f ln 2, to degree 6.
  float p = 1.53526970e-4f;
  p = p * f + 1.33335581e-3f;
  p = p * f + 9.61812911e-3f;
  p = p * f + 5.55041087e-2f;
  p = p * f + 2.40226507e-1f;
  p = p * f + 6.93147182e-1f;
  p = p * f + 1.0f;
  const int32_t exponent = static_cast<int32_t>(n) + 127;  // >= 1 since x >= -87
  const uint32_t bits = static_cast<uint32_t>(exponent) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return vanishes ? 0.0f : p * scale;
}

}  // namespace

// A query's partial result over one segment of its keys (attention.cc): the maximum of its
// scores, the sum of its weights exp(score - maximum), then the sum of the weighted values, not
// yet divided: kPartialHeader + head_dim floats.
inline constexpr int64_t kPartialHeader = 2;

// The attention's passes over the keys [first, end) of row s, key head g (first a multiple of
// 16, end at most the row's cached keys and nodes), for the group's queries of every node
// (node-major: query i is node i / group, head g * group + i % group): each query's partial
// result into partials + i * (kPartialHeader + head_dim). With AVX-512
// (tree_attention_avx512.cc) or AVX2 and FMA (attention_avx2.cc, CPUs without AVX-512); head_dim
// 64 or 128 only.
void segment_avx512(const AttentionProblem& problem, int64_t s, int64_t g, int64_t first,
                    int64_t end, float* partials);
void segment_avx2(const AttentionProblem& problem, int64_t s, int64_t g, int64_t first,
                  int64_t end, float* partials);

// The index of the first maximum of row [cols] of `dtype` (a NaN counts as the maximum), with
// AVX-512 (argmax_avx512.cc); as argmax_rows' portable loop.
int64_t argmax_avx512(const void* row, int64_t cols, Dtype dtype);

}  // namespace sssd::kernels::detail
