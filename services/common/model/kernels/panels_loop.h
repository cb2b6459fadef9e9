// The loop every panel product shares (linear_panels.cc for AVX-512, linear_panels_avx2.cc for
// AVX2): the panels split between the OpenMP threads; in each, the blocks of `block` steps (input
// pairs or inputs) in order and, in each block, the rows `row_tile` at a time,
// add(panel, first row, rows, block begin, block end, the rows' sums, pass, passes)
// accumulating (pass: the row tile's number among the block's `passes`); then finish(panel,
// sums [rows][64]) writes the panel's outputs
// (write_f32_panel for the float32 products).
//
// In an unnamed namespace, as in prefetch.h: the files that include it are compiled for
// different instruction sets, and each must keep its own copy (one shared inline definition
// would leave the linker to pick either, AVX-512 code included, for a CPU without it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace sssd::kernels::detail {
namespace {

template <typename Add, typename Finish>
void run_panels(int64_t rows, int64_t num_panels, int64_t steps, int64_t block, int64_t row_tile,
                const Add& add, const Finish& finish) {
  const int64_t passes = (rows + row_tile - 1) / row_tile;
#pragma omp parallel
  {
    std::vector<float> sums(static_cast<size_t>(rows * 64));
#pragma omp for schedule(static)
    for (int64_t p = 0; p < num_panels; ++p) {
      for (int64_t begin = 0; begin < steps; begin += block) {
        const int64_t end = std::min(begin + block, steps);
        for (int64_t r = 0; r < rows; r += row_tile) {
          add(p, r, std::min(row_tile, rows - r), begin, end, sums.data() + r * 64,
              r / row_tile, passes);
        }
      }
      finish(p, sums.data());
    }
  }
}

// A float32 product's last step for panel p: out[r][64 p + j] = sums[r][j] (+ bias[64 p + j]),
// for the panel's outputs that exist.
inline void write_f32_panel(int64_t p, const float* sums, int64_t rows, const float* bias,
                            float* out, int64_t out_features) {
  const int64_t first = p * 64;
  const int64_t width = std::min<int64_t>(64, out_features - first);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = sums + r * 64;
    float* row_out = out + r * out_features + first;
    for (int64_t j = 0; j < width; ++j) {
      row_out[j] = bias != nullptr ? s[j] + bias[first + j] : s[j];
    }
  }
}

}  // namespace
}  // namespace sssd::kernels::detail
