// What the AVX-512 attention's files share (tree_attention_avx512.cc, attention_scores_amx.cc,
// attention_scores_dpbf16.cc): a thread's scratch, the exp and the reductions, and pass 3 (the
// weighted values), which every path runs on the vector units.
//
// Pass 3 stays on the vector units for every path: the tile unit adds an instruction's 32
// products before it rounds, so weighted values on tiles would round by how a node's keys fall
// into blocks of 32 positions, which differ between a tree and plain decoding. Each output
// element is one sum over the positions in order, whatever the tiling, the blocks of the cache
// or the batch: a query's result depends only on the keys it sees.
//
// The vector helpers are in an unnamed namespace (each file compiled for its instruction set
// keeps its own copy, as numbers.h); the plain structs are shared.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx512_loads.h"
#include "kv_layout.h"
#include "numbers.h"

namespace sssd::kernels::detail {

// Scratch of one thread, kept between calls.
struct Scratch {
  std::vector<float> queries;  // [count, head_dim]
  std::vector<float> scores;  // [count, padded kv length] (scores_amx: [tiles][length][16])
  std::vector<float> weights;  // scores_amx's weights, query-major: [count, padded kv length]
  std::vector<float> keys;  // [16, head_dim] (bfloat16 keys widened)
  // The queries as pairs of bfloat16 dimensions: scores_dpbf16's [HD / 2][queries padded to
  // 16], scores_amx's tiles of 16 queries.
  std::vector<uint32_t> query_pairs;
  std::vector<uint32_t> last_keys;  // scores_dpbf16: a last block of keys, padded with zeros
  std::vector<const void*> key_blocks, value_blocks;  // PagedHead's block pointers
};

inline PagedHead paged_head(const AttentionProblem& problem, int64_t s, int64_t g,
                            int64_t first, int64_t end, Scratch& scratch) {
  return paged_head(problem, s, g, first, end, scratch.key_blocks, scratch.value_blocks);
}

// The scores of the tree attention's pass 1 on other units (attention_scores_amx.cc,
// attention_scores_dpbf16.cc): <query i, key p>, unscaled, for the group's queries of key head g
// of row s (node-major) and keys [0, length) of `head`, query-major (dpbf16: scores[i * stride +
// p]) or key-major (amx: scores[((i / 16) * stride + p) * 16 + i % 16]); false for a head size
// they do not implement (64 and 128 they do).
bool scores_amx(const AttentionProblem& problem, int64_t s, int64_t g, const PagedHead& head,
                int64_t length, int64_t stride, float* scores, Scratch& scratch);
bool scores_dpbf16(const AttentionProblem& problem, int64_t s, int64_t g,
                   const PagedHead& head, int64_t length, int64_t stride, float* scores,
                   Scratch& scratch);
namespace {

// How far ahead of pass 1 its keys are asked for: paged blocks of 16 positions hold one key
// head's 2-4 KB, too short a run for the hardware's prefetcher to follow.
constexpr int64_t kKeysAhead = 64;

// Asks for the run of sixteen positions kKeysAhead on from p0 (of `length`), of the keys
// (pass 1) or the values (pass 3), into the first cache.
template <typename T, int64_t HD>
inline void prefetch_run(const T* (PagedHead::*at)(int64_t) const, const PagedHead& head,
                         int64_t p0, int64_t length) {
  constexpr int64_t kRunBytes = 16 * HD * static_cast<int64_t>(sizeof(T));
  if (p0 + kKeysAhead >= length) return;
  const char* run = reinterpret_cast<const char*>((head.*at)(p0 + kKeysAhead));
  for (int64_t line = 0; line < kRunBytes; line += 64) _mm_prefetch(run + line, _MM_HINT_T0);
}
template <typename T, int64_t HD>
inline void prefetch_keys(const PagedHead& head, int64_t p0, int64_t length) {
  prefetch_run<T, HD>(&PagedHead::key<T>, head, p0, length);
}
template <typename T, int64_t HD>
inline void prefetch_values(const PagedHead& head, int64_t p0, int64_t length) {
  prefetch_run<T, HD>(&PagedHead::value<T>, head, p0, length);
}

// Lane k of the result: the sum of the sixteen lanes of v[k]. Every v[k] is summed by the same
// tree of additions, whatever k.
inline __m512 reduce16(const __m512* v) {
  __m512 pairs[8];  // lanes (v[2j], v[2j+1]) interleaved, half summed
  for (int j = 0; j < 8; ++j) {
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  }
  __m512 quads[4];  // 128-bit lane L: the lane-L sums of v[4j .. 4j + 3]
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(pairs[2 * j]);
    const __m512d b = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                       _mm512_shuffle_f32x4(low, high, 0xDD));
}

// exp_nonpositive (numbers.h) on sixteen lanes.
inline __m512 exp16(__m512 x) {
  const __mmask16 vanishes = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, magic), magic);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.53526970e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33335581e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147182e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i exponent = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(exponent, 23));
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~vanishes), p, scale);
}

// row[p] = exp(row[p] - max(row)) for a row of scores [length], a multiple of 16, whose hidden
// keys hold -inf (and weigh exactly 0); returns the maximum.
inline float exp_from_maximum(float* row, int64_t length) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t p = 0; p < length; p += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + p));
  const __m512 maximum = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t p = 0; p < length; p += 16) {
    _mm512_storeu_ps(row + p, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + p), maximum)));
  }
  return _mm512_cvtss_f32(maximum);
}

// v[0..15] as a 16 x 16 matrix of rows, transposed in place: lane i of v[k] moves to lane k of
// v[i].
inline void transpose16(__m512* v) {
  __m512 pairs[16];  // per 128-bit lane L: elements 4L, 4L + 1 (or 4L + 2, 4L + 3) of two rows
  for (int i = 0; i < 8; ++i) {
    pairs[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  __m512 quads[16];  // quads[4 i + e], 128-bit lane L: element 4L + e of rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    for (int half = 0; half < 2; ++half) {
      const __m512d a = _mm512_castps_pd(pairs[4 * i + half]);
      const __m512d b = _mm512_castps_pd(pairs[4 * i + 2 + half]);
      quads[4 * i + 2 * half] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      quads[4 * i + 2 * half + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
  for (int e = 0; e < 4; ++e) {  // row 4L + e: lane L of quads[e], [4 + e], [8 + e], [12 + e]
    const __m512 low01 = _mm512_shuffle_f32x4(quads[e], quads[4 + e], 0x44);
    const __m512 high01 = _mm512_shuffle_f32x4(quads[e], quads[4 + e], 0xEE);
    const __m512 low23 = _mm512_shuffle_f32x4(quads[8 + e], quads[12 + e], 0x44);
    const __m512 high23 = _mm512_shuffle_f32x4(quads[8 + e], quads[12 + e], 0xEE);
    v[e] = _mm512_shuffle_f32x4(low01, low23, 0x88);
    v[4 + e] = _mm512_shuffle_f32x4(low01, low23, 0xDD);
    v[8 + e] = _mm512_shuffle_f32x4(high01, high23, 0x88);
    v[12 + e] = _mm512_shuffle_f32x4(high01, high23, 0xDD);
  }
}

// Where pass 2 leaves the weights: query i's row of the segment's positions (padded to
// `stride`, a multiple of 16) at scores + i * stride.
struct WeightRows {
  const float* scores;
  int64_t stride;

  const float* row(int64_t i) const { return scores + i * stride; }
};

// Pass 3 for queries [first, first + QT), dimensions [d0, d0 + DIMS) of the head: the sums
// sum_p w_p v_p (into sums, which points at d0, its rows `width` apart) and sum_p w_p (into
// totals[t * width], when d0 is 0) over the positions [0, length) of `head`, a block's run of
// positions at a time. Each output element is one sum over the positions in order, whatever
// QT, DIMS and the blocks.
template <typename T, int64_t HD, int64_t QT, int64_t DIMS>
inline void weigh_values(const WeightRows& weights, int64_t first, const PagedHead& head,
                         int64_t d0, int64_t length, float* sums, float* totals, int64_t width) {
  constexpr int64_t kChunks = DIMS / 16;
  const float* rows[QT];
  __m512 acc[QT][kChunks];
  float total[QT];
  for (int64_t t = 0; t < QT; ++t) {
    rows[t] = weights.row(first + t);
    total[t] = 0.0f;
    for (int64_t c = 0; c < kChunks; ++c) acc[t][c] = _mm512_setzero_ps();
  }
  const bool ask = first == 0 && d0 == 0;  // the pass that reads the values from memory
  for (int64_t start = 0; start < length;) {
    const T* values = head.value<T>(start) + d0;
    const int64_t run = std::min(head.run_from(start), length - start);
    for (int64_t p0 = 0; p0 < run; p0 += 16) {
      if (ask) prefetch_values<T, HD>(head, start + p0, length);
      const int64_t p1 = std::min<int64_t>(run, p0 + 16);
      for (int64_t p = p0; p < p1; ++p) {
        __m512 value[kChunks];
        for (int64_t c = 0; c < kChunks; ++c) value[c] = load16<T>(values + p * HD + 16 * c);
        for (int64_t t = 0; t < QT; ++t) {
          const float weight = rows[t][start + p];
          total[t] += weight;
          const __m512 broadcast = _mm512_set1_ps(weight);
          for (int64_t c = 0; c < kChunks; ++c) {
            acc[t][c] = _mm512_fmadd_ps(broadcast, value[c], acc[t][c]);
          }
        }
      }
    }
    start += run;
  }
  for (int64_t t = 0; t < QT; ++t) {
    if (d0 == 0) totals[t * width] = total[t];
    for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(sums + t * width + 16 * c, acc[t][c]);
  }
}

// weigh_values for QT queries over the whole head, kSliceDims dimensions at a time: six
// queries' accumulators of 64 dimensions (24 registers) beside one position's 64 values (4),
// so a position's values are loaded and widened once per six queries (with 128 dimensions at
// once only two queries fit beside them).
constexpr int64_t kSliceDims = 64;
constexpr int64_t kQueryTile = 6;

template <typename T, int64_t HD, int64_t QT>
inline void weigh_tile(const WeightRows& weights, int64_t first, const PagedHead& head,
                       int64_t length, float* partials) {
  static_assert(HD % kSliceDims == 0, "heads of a multiple of 64 dimensions");
  constexpr int64_t kWidth = kPartialHeader + HD;
  for (int64_t d0 = 0; d0 < HD; d0 += kSliceDims) {
    weigh_values<T, HD, QT, kSliceDims>(weights, first, head, d0, length,
                                        partials + kPartialHeader + d0, partials + 1, kWidth);
  }
}

// Pass 3 for `count` queries over the keys [0, length) of `head`: each query's sums into its
// partial row (kPartialHeader + HD floats, the maximum left to the caller), a tile of queries
// at a time.
template <typename T, int64_t HD>
void weigh_partials(const WeightRows& weights, int64_t count, const PagedHead& head,
                    int64_t length, float* partials) {
  constexpr int64_t kWidth = kPartialHeader + HD;
  int64_t i = 0;
  for (; i + kQueryTile <= count; i += kQueryTile) {
    weigh_tile<T, HD, kQueryTile>(weights, i, head, length, partials + i * kWidth);
  }
  float* out = partials + i * kWidth;
  switch (count - i) {  // the last 1-5 queries as one tile
    case 5: weigh_tile<T, HD, 5>(weights, i, head, length, out); break;
    case 4: weigh_tile<T, HD, 4>(weights, i, head, length, out); break;
    case 3: weigh_tile<T, HD, 3>(weights, i, head, length, out); break;
    case 2: weigh_tile<T, HD, 2>(weights, i, head, length, out); break;
    case 1: weigh_tile<T, HD, 1>(weights, i, head, length, out); break;
    default: break;
  }
}

}  // namespace
}  // namespace sssd::kernels::detail
