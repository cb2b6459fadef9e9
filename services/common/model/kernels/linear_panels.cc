// The matrix products of the verifier's decode steps: y = x W^T (+ b) for a few rows of x,
// bfloat16 with AVX-512 BF16's dot-product instruction (VDPBF16PS) and float32 with fused
// multiply-adds, reading the weights at the speed of memory.
//
// A decode step of a 1.5B model on a CPU is as long as it takes to read its weights once; the
// library kernels read them below the memory's speed, slower still on 1 or 2 rows, and they
// round a row differently with the number of rows beside it (bench/results/2026-11-25). Here the weights are laid out so that a step
// reads them as one stream, and each output is one sum in a fixed order:
//
// - the weight matrix [out_features, in_features] is prepacked in panels of 64 outputs (the
//   last panel padded with zeros): panel p is [in_features / 2][64][2], for each pair of inputs
//   (k, k + 1) the 64 outputs' two weights side by side; one pair of inputs of a panel is four
//   512-bit vectors, and a panel is read front to back;
// - for a row of x, the pair (x[k], x[k + 1]) is broadcast to every lane, and VDPBF16PS adds
//   x[k] w[n][k] + x[k + 1] w[n][k + 1] to output n's float32 sum, pair after pair in order;
// - rows are taken six at a time against the same weight vectors (the vectors come from memory
//   once per six rows), and inputs in blocks of 64 steps (a step: a pair of bfloat16 inputs or
//   a float32 input, 256 bytes of a panel; a block is 16 KB, which stays in the core's first
//   cache while further rows reuse it);
// - output n of row m is then round(sum (+ b[n])) to bfloat16, to nearest even.
//
// So a row's result is the same bits whatever the number of rows, the row's position among them,
// the blocking or the number of threads: plain decoding and the verification of a draft tree
// compute a token's logits identically. Panels are split between the OpenMP threads.
//
// linear_f32 is the same for a float32 model: panels of [in_features][64] float32, one fused
// multiply-add per input in order.
//
// Compiled with -mavx512f -mavx512bf16 (CMakeLists.txt); called only where cpu_paths.h chooses
// the avx512 panels (CPUs that have those instructions).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "panels_loop.h"
#include "prefetch.h"

namespace sssd::kernels {
namespace {

constexpr int64_t kPanel = 64;        // outputs per panel: four vectors of 16 float32 sums
constexpr int64_t kRowTile = 6;       // rows sharing each weight vector read
constexpr int64_t kBlockSteps = 64;   // steps per block (16 KB of a panel)
constexpr int64_t kStepBytes = 256;   // a panel's weights for one input pair or float32 input
// Adds pairs [pair_begin, pair_end) of a panel to the sums of `R` rows.
//   x: the first row's inputs as 32-bit pairs, rows `x_stride` pairs apart;
//   panel: the panel's weights, 4 vectors per pair; sums: [R][64] float32, loaded and stored;
//   pass, passes: which of the block's passes this is (prefetch.h: with more than one, they
//   take turns asking for the next block).
template <int R>
void add_pairs(const uint32_t* x, int64_t x_stride, const __m512i* panel, int64_t pair_begin,
               int64_t pair_end, float* sums, bool first, int64_t pass, int64_t passes) {
  detail::NextBlock next(panel + 4 * pair_end, kStepBytes, pass, passes);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * kPanel + 16 * j);
    }
  }
  for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
    const __m512i* w = panel + 4 * pair;
    if (pass == 0) detail::prefetch_stream(w);  // the later passes find the block in L1
    next.step();
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 1);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 3);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + pair]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xr, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xr, w3);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(sums + r * kPanel + 16 * j, acc[r][j]);
  }
}

using AddPairs = void (*)(const uint32_t*, int64_t, const __m512i*, int64_t, int64_t, float*,
                          bool, int64_t, int64_t);
constexpr AddPairs kAddPairs[kRowTile + 1] = {
    nullptr, add_pairs<1>, add_pairs<2>, add_pairs<3>, add_pairs<4>, add_pairs<5>, add_pairs<6>};

// The float32 counterpart: adds inputs [begin, end) of a panel of [in_features][64] float32
// weights to the sums of `R` rows, one fused multiply-add per input, in order.
template <int R>
void add_inputs(const float* x, int64_t x_stride, const float* panel, int64_t begin,
                int64_t end, float* sums, bool first, int64_t pass, int64_t passes) {
  detail::NextBlock next(panel + kPanel * end, kStepBytes, pass, passes);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * kPanel + 16 * j);
    }
  }
  for (int64_t k = begin; k < end; ++k) {
    const float* w = panel + kPanel * k;
    if (pass == 0) detail::prefetch_stream(w);
    next.step();
    const __m512 w0 = _mm512_loadu_ps(w);
    const __m512 w1 = _mm512_loadu_ps(w + 16);
    const __m512 w2 = _mm512_loadu_ps(w + 32);
    const __m512 w3 = _mm512_loadu_ps(w + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * x_stride + k]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xr, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xr, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(sums + r * kPanel + 16 * j, acc[r][j]);
  }
}

using AddInputs = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, bool,
                           int64_t, int64_t);
constexpr AddInputs kAddInputs[kRowTile + 1] = {
    nullptr, add_inputs<1>, add_inputs<2>, add_inputs<3>, add_inputs<4>, add_inputs<5>,
    add_inputs<6>};

}  // namespace

int64_t packed_bf16_panels(int64_t out_features) { return (out_features + kPanel - 1) / kPanel; }

void round_sums_bf16(const float* sums, const uint16_t* bias, uint16_t* out, int64_t width) {
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t lanes = std::min<int64_t>(16, width - j);
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
    __m512 value = _mm512_loadu_ps(sums + j);
    if (bias != nullptr) {
      const __m256i b = _mm256_maskz_loadu_epi16(mask, bias + j);
      value = _mm512_add_ps(value, _mm512_castsi512_ps(
                                       _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(value);
    _mm256_mask_storeu_epi16(out + j, mask, rounded);
  }
}

void linear_bf16(const void* x, const void* packed, const void* bias, void* out, int64_t rows,
                 int64_t in_features, int64_t out_features) {
  const int64_t num_pairs = in_features / 2;
  const auto* x_pairs = static_cast<const uint32_t*>(x);
  const auto* weights = static_cast<const __m512i*>(packed);
  const auto* bias_bits = static_cast<const uint16_t*>(bias);
  auto* y = static_cast<uint16_t*>(out);
  const auto add = [&](int64_t p, int64_t r, int64_t tile, int64_t begin, int64_t end,
                       float* sums, int64_t pass, int64_t passes) {
    kAddPairs[tile](x_pairs + r * num_pairs, num_pairs, weights + p * num_pairs * 4, begin, end,
                    sums, begin == 0, pass, passes);
  };
  const auto finish = [&](int64_t p, const float* sums) {
    const int64_t first = p * kPanel;
    const int64_t width = std::min(kPanel, out_features - first);
    for (int64_t r = 0; r < rows; ++r) {
      round_sums_bf16(sums + r * kPanel, bias_bits == nullptr ? nullptr : bias_bits + first,
                      y + r * out_features + first, width);
    }
  };
  detail::run_panels(rows, packed_bf16_panels(out_features), num_pairs, kBlockSteps, kRowTile,
                     add, finish);
}

uint64_t read_bytes(const void* data, int64_t num_bytes) {
  const auto* vectors = static_cast<const __m512i*>(data);
  const int64_t num_vectors = num_bytes / 64;
  uint64_t folded = 0;
#pragma omp parallel reduction(| : folded)
  {
    __m512i any = _mm512_setzero_si512();
#pragma omp for schedule(static)
    for (int64_t v = 0; v < num_vectors; v += 4) {  // a 256-byte stretch (4 lines) an iteration
      const int64_t stretch_end = std::min(v + 4, num_vectors);
      detail::prefetch_stream(vectors + v);  // its 4 lines, as the products ask for theirs
      for (int64_t j = v; j < stretch_end; ++j) {
        any = _mm512_or_si512(any, _mm512_loadu_si512(vectors + j));
      }
    }
    folded |= static_cast<uint64_t>(_mm512_reduce_or_epi64(any));
  }
  return folded;
}

void linear_f32(const float* x, const float* packed, const float* bias, float* out,
                int64_t rows, int64_t in_features, int64_t out_features) {
  const auto add = [&](int64_t p, int64_t r, int64_t tile, int64_t begin, int64_t end,
                       float* sums, int64_t pass, int64_t passes) {
    kAddInputs[tile](x + r * in_features, in_features, packed + p * in_features * kPanel, begin,
                     end, sums, begin == 0, pass, passes);
  };
  const auto finish = [&](int64_t p, const float* sums) {
    detail::write_f32_panel(p, sums, rows, bias, out, out_features);
  };
  detail::run_panels(rows, packed_bf16_panels(out_features), in_features, kBlockSteps, kRowTile,
                     add, finish);
}

}  // namespace sssd::kernels
