// Tree attention with AVX2 and FMA over one segment of a (row, key head)'s keys (attention.cc
// cuts a query's keys into segments and merges their partial results), for CPUs without
// AVX-512 (AMD's Zen 2 and Zen 3, Intel's client cores): the group's queries of every node
// against the segment's cached keys and, in a query's last segment, the step's own nodes. Same
// three passes as the AVX-512 one (tree_attention_avx512.cc), tiled for 16 registers of 8 lanes:
// 1. scores: the keys of the (row, head) widened and transposed once into blocks [head_dim][8],
//    so a tile of queries x 2 blocks multiplies one query element, broadcast, by the same element
//    of 8 keys: each score a chain of fused multiply-adds over the head's dimensions in order,
//    with no reduction across lanes; then times the scale;
// 2. the keys a node does not see get -inf, then per query the maximum and exp(score - max)
//    (exp_nonpositive of numbers.h, eight lanes at a time);
// 3. values: a tile of queries x 32 dimensions accumulates weight * value over the positions in
//    order (a key not seen weighs exactly 0 and adds nothing), the sum of the weights beside it
//    in the same order.
// A query's result depends only on the keys it sees, not on the tree, the padding, the batch or
// the tiles it fell in: so plain decoding and the verification of a draft tree compute a token
// identically on this path too. The order within a dot product is not the AVX-512 or the
// portable one's, so the three paths may differ in the last bits; a CPU uses one throughout.
//
// The keys and values are read through the cache's block table (kv_layout.h): keys into the
// transposed blocks, values widened (or, in float32, copied) into one array per segment, in
// position order. The speed against the portable loop it replaces: bench/results/
// 2026-11-29-zen3-avx2-attention.
//
// Compiled with -mavx2 -mfma (CMakeLists.txt); called only on CPUs that have both, where
// cpu_paths.h chooses it (without AVX-512, or forced for the tests).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "numbers.h"

namespace sssd::kernels::detail {
namespace {

template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<uint16_t>(const uint16_t* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// exp_nonpositive (numbers.h) on eight lanes, operation for operation.
inline __m256 exp8(__m256 x) {
  const __m256 vanishes = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.53526970e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.33335581e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.61812911e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.55041087e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40226507e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93147182e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23));
  return _mm256_andnot_ps(vanishes, _mm256_mul_ps(p, scale));
}

// Scratch of one thread, kept between calls.
struct Scratch {
  std::vector<float> queries;  // [count][HD]
  std::vector<float> keys;     // [blocks][HD][8]: keys 8 b .. 8 b + 7, zeros past the last
  std::vector<float> values;   // [length][HD] the values in position order, as float32
  std::vector<float> scores;   // [count][stride]
  std::vector<const void*> key_blocks, value_blocks;  // the (row, head)'s blocks (PagedHead)
};

// scores[i][8 b + lane] for queries [0, R) and key blocks [b0, b0 + KB): the chains over the
// head's dimensions in order, then times the scale.
template <int64_t HD, int R, int KB>
void score_tile(const float* queries, const float* keys, int64_t b0, float scale, float* scores,
                int64_t stride) {
  __m256 acc[R][KB];
  const float* block = keys + b0 * HD * 8;
  for (int kb = 0; kb < KB; ++kb) {
    const __m256 key = _mm256_loadu_ps(block + kb * HD * 8);
    for (int r = 0; r < R; ++r) acc[r][kb] = _mm256_mul_ps(_mm256_broadcast_ss(queries + r * HD),
                                                           key);
  }
  for (int64_t d = 1; d < HD; ++d) {
    __m256 key[KB];
    for (int kb = 0; kb < KB; ++kb) key[kb] = _mm256_loadu_ps(block + kb * HD * 8 + d * 8);
    for (int r = 0; r < R; ++r) {
      const __m256 q = _mm256_broadcast_ss(queries + r * HD + d);
      for (int kb = 0; kb < KB; ++kb) acc[r][kb] = _mm256_fmadd_ps(q, key[kb], acc[r][kb]);
    }
  }
  const __m256 scaled = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    for (int kb = 0; kb < KB; ++kb) {
      _mm256_storeu_ps(scores + r * stride + (b0 + kb) * 8, _mm256_mul_ps(acc[r][kb], scaled));
    }
  }
}

constexpr int kScoreRows = 6;  // 6 queries x 2 key blocks: 12 sums, 2 keys, 1 broadcast

template <int64_t HD, int R>
void score_rows(const float* queries, const float* keys, int64_t blocks, float scale,
                float* scores, int64_t stride) {
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) score_tile<HD, R, 2>(queries, keys, b, scale, scores, stride);
  if (b < blocks) score_tile<HD, R, 1>(queries, keys, b, scale, scores, stride);
}

template <int64_t HD>
void score_all(const float* queries, int64_t count, const float* keys, int64_t blocks,
               float scale, float* scores, int64_t stride) {
  using Rows = void (*)(const float*, const float*, int64_t, float, float*, int64_t);
  static constexpr Rows kRows[kScoreRows + 1] = {
      nullptr, score_rows<HD, 1>, score_rows<HD, 2>, score_rows<HD, 3>, score_rows<HD, 4>,
      score_rows<HD, 5>, score_rows<HD, 6>};
  for (int64_t i = 0; i < count; i += kScoreRows) {
    const int64_t rows = std::min<int64_t>(kScoreRows, count - i);
    kRows[rows](queries + i * HD, keys, blocks, scale, scores + i * stride, stride);
  }
}

// out[r][32 c .. 32 c + 31] (unscaled) for queries [0, R): weight * value over positions [0,
// length) in order, from zero.
template <int64_t HD, int R>
void weigh_tile(const float* weights, int64_t stride, const float* values, int64_t length,
                int64_t c, float* result) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  const float* column = values + 32 * c;
  for (int64_t p = 0; p < length; ++p) {
    __m256 value[4];
    for (int j = 0; j < 4; ++j) value[j] = _mm256_loadu_ps(column + p * HD + 8 * j);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_broadcast_ss(weights + r * stride + p);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(w, value[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(result + r * HD + 32 * c + 8 * j, acc[r][j]);
  }
}

constexpr int kWeighRows = 3;  // 3 queries x 32 dimensions: 12 sums, 4 values, 1 broadcast

template <int64_t HD, int R>
void weigh_rows(const float* weights, int64_t stride, const float* values, int64_t length,
                float* result) {
  for (int64_t c = 0; c < HD / 32; ++c) {
    weigh_tile<HD, R>(weights, stride, values, length, c, result);
  }
}

// Keys [0, length) of `head` widened and transposed into blocks of [HD][8] (keys 8 b ..
// 8 b + 7; zeros past the last).
template <typename T, int64_t HD>
void transpose_keys(const PagedHead& head, int64_t length, int64_t blocks, float* keys_t) {
  for (int64_t b = 0; b < blocks; ++b) {
    float* block = keys_t + b * HD * 8;
    const int64_t width = std::min<int64_t>(8, length - 8 * b);
    for (int64_t lane = 0; lane < 8; ++lane) {
      if (lane >= width) {
        for (int64_t d = 0; d < HD; ++d) block[d * 8 + lane] = 0.0f;
        continue;
      }
      const T* key = head.key<T>(8 * b + lane);
      alignas(32) float wide[HD];
      for (int64_t d = 0; d < HD; d += 8) _mm256_store_ps(wide + d, load8<T>(key + d));
      for (int64_t d = 0; d < HD; ++d) block[d * 8 + lane] = wide[d];
    }
  }
}

// Values [0, length) of `head` as float32 [length][HD] in position order, in `out`.
template <typename T, int64_t HD>
const float* widen_values(const PagedHead& head, int64_t length, std::vector<float>& out) {
  out.resize(length * HD);
  for (int64_t start = 0; start < length;) {
    const T* run = head.value<T>(start);
    const int64_t positions = std::min(head.run_from(start), length - start);
    float* target = out.data() + start * HD;
    for (int64_t e = 0; e < positions * HD; e += 8) {
      _mm256_storeu_ps(target + e, load8<T>(run + e));
    }
    start += positions;
  }
  return out.data();
}

template <typename T, int64_t HD>
void segment_partials(const AttentionProblem& problem, int64_t s, int64_t g, int64_t first,
                      int64_t end, float* partials) {
  constexpr int64_t kWidth = kPartialHeader + HD;
  thread_local Scratch scratch;
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t count = group * num_nodes;  // queries, node-major: i = j * group + k
  const int64_t cached = problem.cache_lens[s];
  const int64_t length = end - first;
  const int64_t blocks = (length + 7) / 8;
  const int64_t stride = blocks * 8;
  scratch.queries.resize(count * HD);
  scratch.keys.resize(blocks * HD * 8);
  scratch.scores.resize(count * stride);
  float* queries = scratch.queries.data();
  float* keys_t = scratch.keys.data();
  float* scores = scratch.scores.data();
  const T* q = static_cast<const T*>(problem.q);
  for (int64_t j = 0; j < num_nodes; ++j) {
    for (int64_t k = 0; k < group; ++k) {
      const T* source = q + ((s * num_nodes + j) * problem.heads + g * group + k) * HD;
      float* target = queries + (j * group + k) * HD;
      for (int64_t d = 0; d < HD; d += 8) _mm256_storeu_ps(target + d, load8<T>(source + d));
    }
  }
  const PagedHead head = paged_head(problem, s, g, first, end, scratch.key_blocks,
                                    scratch.value_blocks);

  // 1. Scores: the keys transposed into blocks of 8 (zeros past the last), then the tiles.
  transpose_keys<T, HD>(head, length, blocks, keys_t);
  score_all<HD>(queries, count, keys_t, blocks, problem.scale, scores, stride);

  // 2. Masked keys, maximum, exp.
  for (int64_t i = 0; i < count; ++i) {
    float* row = scores + i * stride;
    const int64_t j = i / group;
    for (int64_t t = std::max<int64_t>(0, first - cached); cached + t < end; ++t) {
      if (!problem.visible(s, j, cached + t)) row[cached + t - first] = -INFINITY;
    }
    for (int64_t p = length; p < stride; ++p) row[p] = -INFINITY;
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t p = 0; p < stride; p += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + p));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float maximum = *std::max_element(lanes, lanes + 8);
    partials[i * kWidth] = maximum;
    const __m256 broadcast = _mm256_set1_ps(maximum);
    for (int64_t p = 0; p < stride; p += 8) {
      _mm256_storeu_ps(row + p, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + p), broadcast)));
    }
  }

  // 3. Values (widened once, in position order): each query's sums into its partial row.
  const float* wide_values = widen_values<T, HD>(head, length, scratch.values);
  using Rows = void (*)(const float*, int64_t, const float*, int64_t, float*);
  static constexpr Rows kRows[kWeighRows + 1] = {nullptr, weigh_rows<HD, 1>, weigh_rows<HD, 2>,
                                                 weigh_rows<HD, 3>};
  alignas(32) float result[kWeighRows * HD];
  for (int64_t i = 0; i < count; i += kWeighRows) {
    const int64_t rows = std::min<int64_t>(kWeighRows, count - i);
    kRows[rows](scores + i * stride, stride, wide_values, length, result);
    for (int64_t r = 0; r < rows; ++r) {
      const float* weights = scores + (i + r) * stride;
      float total = 0.0f;
      for (int64_t p = 0; p < length; ++p) total += weights[p];
      float* partial = partials + (i + r) * kWidth;
      partial[1] = total;
      std::copy(result + r * HD, result + (r + 1) * HD, partial + kPartialHeader);
    }
  }
}

}  // namespace

void segment_avx2(const AttentionProblem& problem, int64_t s, int64_t g, int64_t first,
                  int64_t end, float* partials) {
  const bool is_float = problem.dtype == Dtype::kFloat32;
  if (problem.head_dim == 64) {
    is_float ? segment_partials<float, 64>(problem, s, g, first, end, partials)
             : segment_partials<uint16_t, 64>(problem, s, g, first, end, partials);
  } else {
    is_float ? segment_partials<float, 128>(problem, s, g, first, end, partials)
             : segment_partials<uint16_t, 128>(problem, s, g, first, end, partials);
  }
}

}  // namespace sssd::kernels::detail
