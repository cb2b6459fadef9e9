// Tree attention with AVX-512 for one (row, key head) pair of a step: the group's queries of
// every node against the row's cached keys and the step's own nodes.
//
// Three passes over the keys, each reading them in position order:
// 1. scores: sixteen keys at a time, each dot product a vector of partial sums, the sixteen
//    vectors reduced together (a transpose by shuffles) into one vector of scores;
// 2. the keys a node does not see get -inf, then per query the maximum and exp(score - max);
// 3. values: a tile of queries accumulates weight * value over the positions in order, with the
//    sum of the weights beside it, and divides at the end.
// A key a query does not see weighs exactly 0, and every sum runs over positions in order, so a
// query's result depends only on the keys it sees (not on the tree, the padding or the batch).
//
// Compiled with -mavx512f (CMakeLists.txt); called only when the CPU has it (has_avx512).
#include <immintrin.h>

#include <vector>

#include "avx512_loads.h"
#include "numbers.h"

namespace sssd::kernels::detail {
namespace {

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

inline void store_row(const float* values, int64_t count, Dtype dtype, void* base,
                      int64_t offset) {
  if (dtype == Dtype::kFloat32) {
    std::memcpy(static_cast<float*>(base) + offset, values, count * sizeof(float));
  } else {
    uint16_t* out = static_cast<uint16_t*>(base) + offset;
    for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(values[i]);
  }
}

// Scratch of one thread, kept between calls.
struct Scratch {
  std::vector<float> queries;  // [count, head_dim]
  std::vector<float> scores;  // [count, padded kv length]
  std::vector<float> keys;  // [16, head_dim] (bfloat16 keys widened)
};

// Pass 3 for queries [first, first + QT): out = sum_p w_p v_p / sum_p w_p.
template <typename T, int64_t HD, int64_t QT>
inline void weigh_values(const float* weights, int64_t stride, const T* values, int64_t length,
                         float* result) {
  constexpr int64_t kChunks = HD / 16;
  __m512 acc[QT][kChunks];
  float totals[QT];
  for (int64_t t = 0; t < QT; ++t) {
    totals[t] = 0.0f;
    for (int64_t c = 0; c < kChunks; ++c) acc[t][c] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < length; ++p) {
    __m512 value[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) value[c] = load16<T>(values + p * HD + 16 * c);
    for (int64_t t = 0; t < QT; ++t) {
      const float weight = weights[t * stride + p];
      totals[t] += weight;
      const __m512 broadcast = _mm512_set1_ps(weight);
      for (int64_t c = 0; c < kChunks; ++c) {
        acc[t][c] = _mm512_fmadd_ps(broadcast, value[c], acc[t][c]);
      }
    }
  }
  for (int64_t t = 0; t < QT; ++t) {
    const __m512 inverse = _mm512_set1_ps(1.0f / totals[t]);
    for (int64_t c = 0; c < kChunks; ++c) {
      _mm512_storeu_ps(result + t * HD + 16 * c, _mm512_mul_ps(acc[t][c], inverse));
    }
  }
}

template <typename T, int64_t HD>
void attend(const AttentionProblem& problem, int64_t s, int64_t g) {
  constexpr int64_t kChunks = HD / 16;
  // Query tiles of pass 3: accumulators and one value in registers (32 of them).
  constexpr int64_t kTile = HD == 64 ? 4 : 2;
  thread_local Scratch scratch;
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t count = group * num_nodes;  // queries, node-major: i = j * group + k
  const int64_t cached = problem.cache_lens[s];
  const int64_t length = cached + num_nodes;  // keys: the cache, then the step's nodes
  const int64_t stride = (length + 15) / 16 * 16;
  scratch.queries.resize(count * HD);
  scratch.scores.resize(count * stride);
  scratch.keys.resize(16 * HD);
  float* queries = scratch.queries.data();
  float* scores = scratch.scores.data();
  const T* q = static_cast<const T*>(problem.q);
  for (int64_t j = 0; j < num_nodes; ++j) {
    for (int64_t k = 0; k < group; ++k) {
      const T* source = q + ((s * num_nodes + j) * problem.heads + g * group + k) * HD;
      float* target = queries + (j * group + k) * HD;
      for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(target + 16 * c,
                                                             load16<T>(source + 16 * c));
    }
  }
  const int64_t offset = problem.cache_offset(s, g);
  const T* keys = static_cast<const T*>(problem.key_cache) + offset;
  const T* values = static_cast<const T*>(problem.value_cache) + offset;
  const __m512 scale = _mm512_set1_ps(problem.scale);

  // 1. Scores, sixteen keys at a time.
  for (int64_t p0 = 0; p0 < length; p0 += 16) {
    const int64_t block = std::min<int64_t>(16, length - p0);
    const float* block_keys;
    if constexpr (sizeof(T) == sizeof(float)) {
      block_keys = reinterpret_cast<const float*>(keys) + p0 * HD;
    } else {
      float* widened = scratch.keys.data();
      for (int64_t k = 0; k < block * HD; k += 16) {
        _mm512_storeu_ps(widened + k, load16<T>(keys + p0 * HD + k));
      }
      block_keys = widened;
    }
    for (int64_t i = 0; i < count; ++i) {
      const float* query = queries + i * HD;
      __m512 partial[16];
      for (int64_t k = 0; k < 16; ++k) {
        if (k >= block) {
          partial[k] = _mm512_setzero_ps();
          continue;
        }
        const float* key = block_keys + k * HD;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(query), _mm512_loadu_ps(key));
        for (int64_t c = 1; c < kChunks; ++c) {
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(query + 16 * c), _mm512_loadu_ps(key + 16 * c),
                                acc);
        }
        partial[k] = acc;
      }
      _mm512_storeu_ps(scores + i * stride + p0, _mm512_mul_ps(reduce16(partial), scale));
    }
  }

  // 2. Masked keys, maximum, exp.
  for (int64_t i = 0; i < count; ++i) {
    float* row = scores + i * stride;
    const int64_t j = i / group;
    for (int64_t t = 0; t < num_nodes; ++t) {
      if (!problem.visible(s, j, cached + t)) row[cached + t] = -INFINITY;
    }
    for (int64_t p = length; p < stride; ++p) row[p] = -INFINITY;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t p = 0; p < stride; p += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + p));
    const __m512 maximum = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int64_t p = 0; p < stride; p += 16) {
      _mm512_storeu_ps(row + p, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + p), maximum)));
    }
  }

  // 3. Values, a tile of queries at a time, then the output in the model's dtype.
  float result[kTile * HD];
  int64_t i = 0;
  const auto write = [&](int64_t first, int64_t tile) {
    for (int64_t t = 0; t < tile; ++t) {
      const int64_t query = first + t, j = query / group, k = query % group;
      store_row(result + t * HD, HD, problem.dtype, problem.out,
                ((s * num_nodes + j) * problem.heads + g * group + k) * HD);
    }
  };
  for (; i + kTile <= count; i += kTile) {
    weigh_values<T, HD, kTile>(scores + i * stride, stride, values, length, result);
    write(i, kTile);
  }
  for (; i < count; ++i) {
    weigh_values<T, HD, 1>(scores + i * stride, stride, values, length, result);
    write(i, 1);
  }
}

}  // namespace

bool attend_avx512(const AttentionProblem& problem, int64_t s, int64_t g) {
  const bool is_float = problem.dtype == Dtype::kFloat32;
  switch (problem.head_dim) {
    case 64:
      is_float ? attend<float, 64>(problem, s, g) : attend<uint16_t, 64>(problem, s, g);
      return true;
    case 128:
      is_float ? attend<float, 128>(problem, s, g) : attend<uint16_t, 128>(problem, s, g);
      return true;
    default:
      return false;
  }
}

}  // namespace sssd::kernels::detail
