// argmax_rows: each row's first maximum, as torch.argmax (a NaN counts as the maximum, -0.0
// equals 0.0), greedy verification's token per node. The portable loop here, the AVX-512 one in
// argmax_avx512.cc; cpu_paths.h chooses.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "cpu_paths.h"
#include "kernels.h"
#include "rows.h"

namespace sssd::kernels {

using detail::bf16_to_float;

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
  const bool vector = path_of(Kernel::kArgmax, dtype) == Path::kAvx512;
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

}  // namespace sssd::kernels
