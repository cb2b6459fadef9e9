// The first maximum of a row of logits with AVX-512 (argmax_rows, argmax.cc): one pass for
// the maximum, sixteen values a vector in four independent chains, NaNs noted on the way; then
// one for the first value equal to it, sixteen compared at once.
//
// Compiled with -mavx512f -mavx512bw (CMakeLists.txt); called only when the CPU has AVX-512.
#include <immintrin.h>

#include <cmath>

#include "avx512_loads.h"
#include "numbers.h"

namespace sssd::kernels::detail {
namespace {

constexpr int64_t kWidth = 16;  // float32 values in a vector

inline float scalar(const float* row, int64_t i) { return row[i]; }
inline float scalar(const uint16_t* row, int64_t i) { return bf16_to_float(row[i]); }

// The row's largest value, or NaN when it holds one.
template <typename T>
float row_max(const T* row, int64_t cols) {
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 4 * kWidth <= cols; i += 4 * kWidth) {
    const __m512 v0 = load16(row + i), v1 = load16(row + i + kWidth);
    const __m512 v2 = load16(row + i + 2 * kWidth), v3 = load16(row + i + 3 * kWidth);
    nan |= _mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v2, v3, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, v0);
    m1 = _mm512_max_ps(m1, v1);
    m2 = _mm512_max_ps(m2, v2);
    m3 = _mm512_max_ps(m3, v3);
  }
  float best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  bool has_nan = nan != 0;
  for (; i < cols; ++i) {
    const float v = scalar(row, i);
    has_nan |= std::isnan(v);
    best = v > best ? v : best;
  }
  return has_nan ? NAN : best;
}

template <typename T>
int64_t first_equal(const T* row, int64_t cols, float target) {
  const bool nan = std::isnan(target);
  const __m512 wanted = _mm512_set1_ps(target);
  int64_t i = 0;
  for (; i + kWidth <= cols; i += kWidth) {
    const __m512 v = load16(row + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(v, wanted, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (; i < cols; ++i) {
    const float v = scalar(row, i);
    if (nan ? std::isnan(v) : v == target) return i;
  }
  return cols - 1;  // not reached: the target is one of the row's values
}

template <typename T>
int64_t argmax(const T* row, int64_t cols) { return first_equal(row, cols, row_max(row, cols)); }

}  // namespace

int64_t argmax_avx512(const void* row, int64_t cols, Dtype dtype) {
  return dtype == Dtype::kFloat32 ? argmax(static_cast<const float*>(row), cols)
                                  : argmax(static_cast<const uint16_t*>(row), cols);
}

}  // namespace sssd::kernels::detail
