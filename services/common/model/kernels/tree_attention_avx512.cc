// Tree attention with AVX-512 over one segment of a (row, key head)'s keys (attention.cc cuts
// a query's keys into segments and merges their partial results): the group's queries of every
// node against the segment's cached keys and, in a query's last segment, the step's own nodes.
//
// Three passes over the segment's keys, each reading them in position order:
// 1. scores: sixteen keys at a time, each dot product a vector of partial sums, the sixteen
//    vectors reduced together (a transpose by shuffles) into one vector of scores; in bfloat16
//    on the tile unit (attention_scores_amx.cc) or with AVX-512 BF16's dot products
//    (attention_scores_dpbf16.cc) where cpu_paths.h chooses them, whose scores are each still
//    a function of its query and its key alone;
// 2. the keys a node does not see get -inf, then per query the maximum and exp(score - max);
// 3. values: a tile of queries accumulates weight * value over the positions in order, with the
//    sum of the weights beside it (attention_avx512.h).
// A key a query does not see weighs exactly 0, and every sum runs over positions in order, so a
// query's partial result depends only on the keys it sees in the segment (not on the tree, the
// padding, the batch or the cache's blocks). The paths' scores differ in the order of their
// sums, so a process uses one of them throughout. Pass 1 asks for the keys ahead of it and
// pass 3 for the values ahead of it (attention_avx512.h): a paged block holds too short a run
// for the hardware's prefetcher.
//
// Compiled with -mavx512f and its BW, DQ, VL extensions (CMakeLists.txt); called only where the
// CPU has them.
#include <algorithm>
#include <cstring>

#include "attention_avx512.h"

namespace sssd::kernels::detail {
namespace {

// Pass 1 on the vector units: scores[i * stride + p] = scale * <query i, key p> for the `count`
// widened queries (rows HD apart) and keys [0, length) of `head`, sixteen keys at a time, each
// dot product a vector of partial sums, the sixteen vectors reduced together.
template <typename T, int64_t HD>
void vector_scores_of(const float* queries, int64_t count, const PagedHead& head,
                      int64_t length, int64_t stride, __m512 scale, float* scores,
                      Scratch& scratch) {
  constexpr int64_t kChunks = HD / 16;
  for (int64_t p0 = 0; p0 < length; p0 += 16) {
    const int64_t block = std::min<int64_t>(16, length - p0);
    prefetch_keys<T, HD>(head, p0, length);
    const T* keys = head.key<T>(p0);  // 16 positions of one block of the cache
    const float* block_keys;
    if constexpr (sizeof(T) == sizeof(float)) {
      block_keys = reinterpret_cast<const float*>(keys);
    } else {
      float* widened = scratch.keys.data();
      for (int64_t k = 0; k < block * HD; k += 16) {
        _mm512_storeu_ps(widened + k, load16<T>(keys + k));
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
}

// Pass 2 over the tile unit's key-major scores of keys [first, end) of row s: scaled, the step's
// nodes a query does not see at -inf, then per query (a lane of its tile) the maximum, into its
// partial row, and exp(score - maximum), transposed sixteen positions at a time into the
// queries' rows of `weights` for pass 3 (which reads a query's weights in order). Elementwise,
// so the weights are those of the same scores query-major.
inline void weigh_key_major(const AttentionProblem& problem, int64_t s, int64_t first,
                            int64_t end, int64_t count, __m512 scale, float* scores,
                            int64_t stride, float* weights, float* partials) {
  const int64_t width = kPartialHeader + problem.head_dim, group = problem.group();
  const int64_t cached = problem.cache_lens[s], length = end - first;
  const int64_t tail = std::max(first, cached) - first;  // the step's nodes from here on
  const uint64_t* bits = problem.tree_bits + s * problem.num_nodes;
  const __m512 hidden = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t * 16 < count; ++t) {
    float* block = scores + t * stride * 16;
    const int64_t lanes = std::min<int64_t>(16, count - 16 * t);
    uint64_t seen[16];  // lane's node's tree bits (which of the step's nodes it sees)
    for (int64_t lane = 0; lane < 16; ++lane) {
      seen[lane] = lane < lanes ? bits[(16 * t + lane) / group] : ~uint64_t{0};
    }
    // Scaled, the nodes a lane does not see at -inf, and the lanes' maximum, in one pass.
    __m512 top = hidden;
    for (int64_t p = 0; p < length; ++p) {
      __m512 row = _mm512_mul_ps(_mm512_loadu_ps(block + p * 16), scale);
      if (p >= tail) {
        const int64_t node = first + p - cached;
        __mmask16 unseen = 0;
        for (int64_t lane = 0; lane < 16; ++lane) {
          unseen |= static_cast<__mmask16>((~seen[lane] >> node & 1u) << lane);
        }
        row = _mm512_mask_mov_ps(row, unseen, hidden);
      }
      _mm512_storeu_ps(block + p * 16, row);
      top = _mm512_max_ps(top, row);
    }
    // exp(score - maximum), transposed sixteen positions at a time into the lanes' rows (the
    // positions past `length` are never read).
    for (int64_t p0 = 0; p0 < length; p0 += 16) {
      __m512 rows[16];
      for (int64_t k = 0; k < 16; ++k) {
        rows[k] = p0 + k < length
                      ? exp16(_mm512_sub_ps(_mm512_loadu_ps(block + (p0 + k) * 16), top))
                      : _mm512_setzero_ps();
      }
      transpose16(rows);  // rows[lane]: query 16 t + lane's weights of the sixteen positions
      for (int64_t lane = 0; lane < lanes; ++lane) {
        _mm512_storeu_ps(weights + (16 * t + lane) * stride + p0, rows[lane]);
      }
    }
    alignas(64) float maxima[16];
    _mm512_store_ps(maxima, top);
    for (int64_t lane = 0; lane < lanes; ++lane) partials[(16 * t + lane) * width] = maxima[lane];
  }
}

// Passes 1-3 over the keys [first, end) of row s, key head g, for all the group's queries of
// every node (node-major: i = j * group + k): each query's partial result into
// partials + i * (kPartialHeader + HD). `first` is a multiple of 16.
template <typename T, int64_t HD>
void segment_partials(const AttentionProblem& problem, int64_t s, int64_t g, int64_t first,
                      int64_t end, float* partials) {
  constexpr int64_t kChunks = HD / 16;
  constexpr int64_t kWidth = kPartialHeader + HD;
  thread_local Scratch scratch;
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t count = group * num_nodes;
  const int64_t cached = problem.cache_lens[s];
  const int64_t length = end - first;
  const int64_t stride = (length + 15) / 16 * 16;
  const bool amx = sizeof(T) == sizeof(uint16_t) && problem.amx;
  const bool dpbf16 = sizeof(T) == sizeof(uint16_t) && problem.dpbf16;  // never with amx
  const bool vector_scores = !amx && !dpbf16;
  scratch.queries.resize(count * HD);
  scratch.scores.resize((amx ? (count + 15) / 16 * 16 : count) * stride);
  scratch.keys.resize(16 * HD);
  float* queries = scratch.queries.data();
  float* scores = scratch.scores.data();
  const T* q = static_cast<const T*>(problem.q);
  for (int64_t j = 0; vector_scores && j < num_nodes; ++j) {  // widened for the vector loop
    for (int64_t k = 0; k < group; ++k) {
      const T* source = q + ((s * num_nodes + j) * problem.heads + g * group + k) * HD;
      float* target = queries + (j * group + k) * HD;
      for (int64_t c = 0; c < kChunks; ++c) _mm512_storeu_ps(target + 16 * c,
                                                             load16<T>(source + 16 * c));
    }
  }
  const PagedHead head = paged_head(problem, s, g, first, end, scratch);
  const __m512 scale = _mm512_set1_ps(problem.scale);

  // 1. Scores, sixteen keys at a time (on the tile unit or with the dot products: scaled in
  // pass 2).
  if (amx) scores_amx(problem, s, g, head, length, stride, scores, scratch);
  if (dpbf16) scores_dpbf16(problem, s, g, head, length, stride, scores, scratch);
  if (vector_scores) vector_scores_of<T, HD>(queries, count, head, length, stride, scale,
                                             scores, scratch);

  // 2. Masked keys, maximum, exp.
  if (amx) {
    scratch.weights.resize(count * stride);
    weigh_key_major(problem, s, first, end, count, scale, scores, stride,
                    scratch.weights.data(), partials);
  } else {
    for (int64_t i = 0; i < count; ++i) {
      float* row = scores + i * stride;
      const int64_t j = i / group;
      if (!vector_scores) {
        for (int64_t p = 0; p < length; p += 16) {
          _mm512_storeu_ps(row + p, _mm512_mul_ps(_mm512_loadu_ps(row + p), scale));
        }
      }
      for (int64_t t = std::max<int64_t>(0, first - cached); cached + t < end; ++t) {
        if (!problem.visible(s, j, cached + t)) row[cached + t - first] = -INFINITY;
      }
      for (int64_t p = length; p < stride; ++p) row[p] = -INFINITY;
      partials[i * kWidth] = exp_from_maximum(row, stride);
    }
  }

  // 3. Values.
  const WeightRows weights{amx ? scratch.weights.data() : scores, stride};
  weigh_partials<T, HD>(weights, count, head, length, partials);
}

}  // namespace

void segment_avx512(const AttentionProblem& problem, int64_t s, int64_t g, int64_t first,
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
