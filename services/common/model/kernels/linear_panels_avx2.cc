// The panel products (linear_panels.cc) for CPUs with AVX2 and FMA but no AVX-512: AMD's Zen 2
// and Zen 3, Intel's client cores, most of the smaller cloud instances. Same packed panels,
// same contract: a row's result is the same bits whatever the rows beside it, the blocking or
// the number of threads, so plain decoding and the verification of a draft tree compute a
// token's logits identically here too.
//
// Without VDPBF16PS a bfloat16 weight becomes a float32 one by a shift: a 256-bit load of a
// panel's step holds 8 outputs' input pairs (w[n][2t] in the low half of each 32-bit lane,
// w[n][2t + 1] in the high half), so `lane << 16` is the first weight and `lane & 0xffff0000`
// the second, exactly. Each output's sum then takes x[2t] w[n][2t] and x[2t + 1] w[n][2t + 1]
// by two fused multiply-adds, pair after pair in order, and is rounded to bfloat16 (nearest
// even) once at the end. That order is not VDPBF16PS's, so this build and the AVX-512 one may
// differ in the last bit of a product: each machine decodes with one of them throughout.
//
// A pass takes a whole panel (64 outputs, 8 registers of sums a row) and 1 or 2 rows: 16
// independent sums for 2 rows, where each sum's own multiply-adds follow one another (two a pair,
// each waiting for the last). With half a panel a pass the two FMA units wait on those chains; a
// whole panel spills a few sums to the stack but keeps both units busy (3 or 4 rows a pass spill
// more than they save; bench/results/2026-11-29-zen3-whole-panels). The inputs are broadcast
// again for each vector of outputs (from L1) rather than held, which leaves the registers to the
// sums. The block (64 steps, 16 KB) that the first pass read from memory stays in the core's
// first cache for the others.
//
// Compiled with -mavx2 -mfma (CMakeLists.txt); called only where cpu_paths.h chooses the avx2
// panels (CPUs that have both).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "numbers.h"
#include "panels_loop.h"
#include "prefetch.h"

namespace sssd::kernels {
namespace {

constexpr int64_t kHalf = 32;         // outputs of a float32 pass: four vectors of 8 sums
constexpr int64_t kVectors = 8;       // vectors of 8 outputs in a panel
// Rows of a pass: for bfloat16, a whole panel's sums a row (above); for float32 from 9 rows
// on, half a panel's sums (4 registers a row) and each row's broadcast input fit in the 16
// registers (to 8 rows, a whole panel and 2 rows, as for bfloat16: add_inputs_whole).
constexpr int64_t kRowTileBf16 = 2;
constexpr int64_t kRowTileF32 = 3;
constexpr int64_t kBlockSteps = 64;   // steps per block (16 KB of a panel), as linear_panels.cc
constexpr int64_t kStepBytes = 256;   // a panel's weights for one input pair or float32 input
// A whole-panel pass's sums of R rows ([R][64] float32 at `sums`) into registers, zero on the
// first block; and back.
template <int R>
inline void load_sums(__m256 (&acc)[R][kVectors], const float* sums, bool first) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kVectors; ++j) {
      acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * 64 + 8 * j);
    }
  }
}

template <int R>
inline void store_sums(const __m256 (&acc)[R][kVectors], float* sums) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < kVectors; ++j) _mm256_storeu_ps(sums + r * 64 + 8 * j, acc[r][j]);
  }
}

// Adds pairs [pair_begin, pair_end) of a bfloat16 panel to the sums of `R` rows, the whole
// panel in one pass. x: the first row's inputs in float32, rows `x_stride` floats apart; panel:
// the panel's [pairs][64] 32-bit input pairs; sums: [R][64] float32.
template <int R>
void add_pairs(const float* x, int64_t x_stride, const uint32_t* panel, int64_t pair_begin,
               int64_t pair_end, float* sums, bool first, int64_t pass, int64_t passes) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  detail::NextBlock next(panel + 64 * pair_end, kStepBytes, pass, passes);
  __m256 acc[R][kVectors];
  load_sums<R>(acc, sums, first);
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    const uint32_t* step = panel + 64 * pair;
    if (pass == 0) detail::prefetch_stream(step);  // the later passes find the block in L1
    next.step();
    const float* inputs = x + 2 * pair;
    for (int j = 0; j < kVectors; ++j) {
      const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 8 * j));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(lanes, high));
      for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(inputs + r * x_stride), w0, acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(inputs + r * x_stride + 1), w1,
                                    acc[r][j]);
      }
    }
  }
  store_sums<R>(acc, sums);
}

using AddPairs = void (*)(const float*, int64_t, const uint32_t*, int64_t, int64_t, float*, bool,
                          int64_t, int64_t);
constexpr AddPairs kAddPairs[kRowTileBf16 + 1] = {nullptr, add_pairs<1>, add_pairs<2>};

// The float32 counterpart: one fused multiply-add per input, in order.
template <int R>
void add_inputs(const float* x, int64_t x_stride, const float* panel, int64_t begin, int64_t end,
                float* sums, bool first, int64_t pass, int64_t passes) {
  for (int64_t half = 0; half < 2; ++half) {
    detail::NextBlock next(panel + 64 * end, kStepBytes, pass, passes);
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) {
        acc[r][j] = first ? _mm256_setzero_ps()
                          : _mm256_loadu_ps(sums + r * 64 + half * kHalf + 8 * j);
      }
    }
    for (int64_t k = begin; k < end; ++k) {
      const float* step = panel + 64 * k;
      if (half == 0) {
        if (pass == 0) detail::prefetch_stream(step);
        next.step();
      }
      __m256 xk[R];
      for (int r = 0; r < R; ++r) xk[r] = _mm256_broadcast_ss(x + r * x_stride + k);
      const float* w = step + half * kHalf;
      for (int j = 0; j < 4; ++j) {
        const __m256 wj = _mm256_loadu_ps(w + 8 * j);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(xk[r], wj, acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(sums + r * 64 + half * kHalf + 8 * j, acc[r][j]);
      }
    }
  }
}

// The same over the whole panel in one pass, as add_pairs: up to kRowTileF32Panel rows, 8
// sums a row. Faster while the weights stream from memory (few rows), slower once the
// arithmetic dominates, where the half-panel passes above reuse each loaded vector for 3 rows
// (bench/results/2026-11-29-zen3-whole-panels).
template <int R>
void add_inputs_whole(const float* x, int64_t x_stride, const float* panel, int64_t begin,
                      int64_t end, float* sums, bool first, int64_t pass, int64_t passes) {
  detail::NextBlock next(panel + 64 * end, kStepBytes, pass, passes);
  __m256 acc[R][kVectors];
  load_sums<R>(acc, sums, first);
  for (int64_t k = begin; k < end; ++k) {
    const float* step = panel + 64 * k;
    if (pass == 0) detail::prefetch_stream(step);
    next.step();
    for (int j = 0; j < kVectors; ++j) {
      const __m256 wj = _mm256_loadu_ps(step + 8 * j);
      for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * x_stride + k), wj, acc[r][j]);
      }
    }
  }
  store_sums<R>(acc, sums);
}

using AddInputs = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, bool,
                           int64_t, int64_t);
constexpr AddInputs kAddInputs[kRowTileF32 + 1] = {nullptr, add_inputs<1>, add_inputs<2>,
                                                   add_inputs<3>};
constexpr int64_t kRowTileF32Panel = 2;
constexpr int64_t kWholePanelRows = 8;  // products of at most this many rows pass whole panels
constexpr AddInputs kAddInputsWhole[kRowTileF32Panel + 1] = {nullptr, add_inputs_whole<1>,
                                                             add_inputs_whole<2>};

}  // namespace


void linear_bf16_avx2(const void* x, const void* packed, const void* bias, void* out,
                      int64_t rows, int64_t in_features, int64_t out_features) {
  const int64_t num_pairs = in_features / 2;
  const auto* x_bits = static_cast<const uint16_t*>(x);
  std::vector<float> x32(static_cast<size_t>(rows * in_features));  // the inputs, exactly
  for (int64_t i = 0; i < rows * in_features; ++i) x32[i] = detail::bf16_to_float(x_bits[i]);
  const auto* weights = static_cast<const uint32_t*>(packed);
  const auto* bias_bits = static_cast<const uint16_t*>(bias);
  auto* y = static_cast<uint16_t*>(out);
  const auto add = [&](int64_t p, int64_t r, int64_t tile, int64_t begin, int64_t end,
                       float* sums, int64_t pass, int64_t passes) {
    kAddPairs[tile](x32.data() + r * in_features, in_features, weights + p * num_pairs * 64,
                    begin, end, sums, begin == 0, pass, passes);
  };
  const auto finish = [&](int64_t p, const float* sums) {
    const int64_t first = p * 64;
    const int64_t width = std::min<int64_t>(64, out_features - first);
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* row_out = y + r * out_features + first;
      for (int64_t j = 0; j < width; ++j) {
        float sum = sums[r * 64 + j];
        if (bias_bits != nullptr) sum += detail::bf16_to_float(bias_bits[first + j]);
        row_out[j] = detail::float_to_bf16(sum);
      }
    }
  };
  detail::run_panels(rows, packed_bf16_panels(out_features), num_pairs, kBlockSteps,
                     kRowTileBf16, add,
                     finish);
}

void linear_f32_avx2(const float* x, const float* packed, const float* bias, float* out,
                     int64_t rows, int64_t in_features, int64_t out_features) {
  // Each output's sum is the same chain of multiply-adds either way: the choice by the number
  // of rows changes the speed, not a bit of any row.
  const bool whole = rows <= kWholePanelRows;
  const AddInputs* kernels = whole ? kAddInputsWhole : kAddInputs;
  const auto add = [&](int64_t p, int64_t r, int64_t tile, int64_t begin, int64_t end,
                       float* sums, int64_t pass, int64_t passes) {
    kernels[tile](x + r * in_features, in_features, packed + p * in_features * 64, begin, end,
                  sums, begin == 0, pass, passes);
  };
  const auto finish = [&](int64_t p, const float* sums) {
    detail::write_f32_panel(p, sums, rows, bias, out, out_features);
  };
  detail::run_panels(rows, packed_bf16_panels(out_features), in_features, kBlockSteps,
                     whole ? kRowTileF32Panel : kRowTileF32, add, finish);
}

uint64_t read_bytes_avx2(const void* data, int64_t num_bytes) {
  const auto* vectors = static_cast<const __m256i*>(data);
  const int64_t num_vectors = num_bytes / 32;
  uint64_t folded = 0;
#pragma omp parallel reduction(| : folded)
  {
    __m256i any = _mm256_setzero_si256();
#pragma omp for schedule(static)
    for (int64_t v = 0; v < num_vectors; v += 8) {  // a 256-byte stretch (4 lines) an iteration
      const int64_t stretch_end = std::min(v + 8, num_vectors);
      detail::prefetch_stream(vectors + v);
      for (int64_t j = v; j < stretch_end; ++j) {
        any = _mm256_or_si256(any, _mm256_loadu_si256(vectors + j));
      }
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), any);
    folded |= lanes[0] | lanes[1] | lanes[2] | lanes[3];
  }
  return folded;
}

}  // namespace sssd::kernels
