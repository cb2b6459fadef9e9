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
// In bfloat16 on CPUs with AMX, pass 1 runs on the tile unit instead (scores_amx): a tile of
// 16 queries times 16 keys per instruction over 32 of the head's dimensions, where the vector
// loop spends a dot product per query and key. A score is still a function of its query and
// its key alone (each output of TDPBF16PS is its row of the one tile times its column of the
// other), so the same holds; the scores differ from the vector loop's in the order of their
// sums, so a process uses one of the two throughout. Pass 3 stays on the vector units: the tile
// unit adds an instruction's 32 products before it rounds (a scratch probe: two products of
// half an ulp each moved a sum of 1.0 wherever they sat in the instruction), so weighted values
// on tiles would round by how a node's keys fall into blocks of 32 positions, which differ
// between a tree and plain decoding. Before it, pass 1 took about two thirds
// of a tree's attention: 0.78 ms a layer for a tree of 16 nodes over 800 keys of
// Qwen2.5-Coder-1.5B (22 ms a step), where one node took 0.06.
//
// In bfloat16 on CPUs with AVX-512 BF16 and no AMX (AMD Zen 4 and later), pass 1 runs on its
// dot-product instruction instead (scores_dpbf16): lanes are sixteen queries, one instruction
// adds a pair of dimensions of one key (broadcast) to all sixteen scores, and sixteen keys'
// scores are transposed into rows at the end. A score is the sum over the head's pairs of
// dimensions, in order, of its query's and key's products: a function of the two alone. The
// vector loop reloads every query and key element per score and folds sixteen partial sums;
// here a key's pair is read once per sixteen queries and a query's once per sixteen keys. On a
// 2-core Zen 4, Qwen2.5-Coder-1.5B's heads over 800 cached keys (bench/tree_attention.py), one
// layer of a tree of 8 nodes: 148 us, against 374 with the vector loop; one node 28.9 and 51.8.
//
// Compiled with -mavx512f, -mavx512bf16 and the AMX flags (CMakeLists.txt); called only when the
// CPU has AVX-512 (has_avx512), its dot products only when has_avx512_bf16(), its tile
// instructions only when has_amx_bf16().
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
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

// row[p] = exp(row[p] - max(row)) for a row of scores [length], a multiple of 16, whose hidden
// keys hold -inf (and weigh exactly 0).
inline void exp_from_maximum(float* row, int64_t length) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t p = 0; p < length; p += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + p));
  const __m512 maximum = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t p = 0; p < length; p += 16) {
    _mm512_storeu_ps(row + p, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + p), maximum)));
  }
}

// Scratch of one thread, kept between calls.
struct Scratch {
  std::vector<float> queries;  // [count, head_dim]
  std::vector<float> scores;  // [count, padded kv length]
  std::vector<float> keys;  // [16, head_dim] (bfloat16 keys widened)
  std::vector<uint16_t> query_bits;  // scores_amx: [count padded to 16, head_dim] bfloat16
  std::vector<uint32_t> key_pairs;  // scores_amx: a block of 16 keys as tiles of pairs
  std::vector<uint32_t> query_pairs;  // scores_dpbf16: [HD / 2][queries padded to 16] pairs
  std::vector<uint32_t> last_keys;  // scores_dpbf16: a last block of keys, padded with zeros
};

// Positions [first, first + 16) of one key head's bfloat16 keys [length, HD] as the tile unit
// reads a block of 16 keys: [HD / 2][16] pairs of dimensions (dimensions 2r and 2r + 1 of a
// key side by side, row r of the tile of its span r / 16); a position at or past `length` as
// zeros.
template <int64_t HD>
void pack_key_pairs(const uint16_t* keys, int64_t first, int64_t length, uint32_t* out) {
  const int64_t block = std::max<int64_t>(0, std::min<int64_t>(16, length - first));
  const __mmask16 present = static_cast<__mmask16>((1u << block) - 1u);
  const __m512i key_starts = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(HD / 2));
  const void* base = keys + first * HD;
  for (int64_t pair = 0; pair < HD / 2; ++pair) {
    _mm512_storeu_si512(out + pair * 16, _mm512_mask_i32gather_epi32(
        _mm512_setzero_si512(), present,
        _mm512_add_epi32(key_starts, _mm512_set1_epi32(static_cast<int>(pair))), base, 4));
  }
}

// Pass 1 on the AMX tile unit: scores[i * stride + p] = <query i, key p> (unscaled) for the
// `count` queries of key head g of row s (node-major, as in attend) and keys [0, length);
// queries past `count` (up to a multiple of 16) get rows of their own, which the caller sizes.
// A block of 16 keys is rearranged once into the tile layout of pairs (dimensions 2r and
// 2r + 1 of each key side by side); a key past `length` as zeros. Tiles (kTiles16x64): tmm0
// the scores of 16 queries x 16 keys (float32), tmm1 16 queries x 32 dimensions (bfloat16),
// tmm2 16 pairs of dimensions x 16 keys x 2 (bfloat16).
template <int64_t HD>
void scores_amx(const AttentionProblem& problem, int64_t s, int64_t g, const uint16_t* keys,
                int64_t length, int64_t stride, float* scores, Scratch& scratch) {
  constexpr int64_t kSpans = HD / 32;  // 32 dimensions (64 bytes) per tile row
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t count = group * num_nodes;
  const int64_t tiles = (count + 15) / 16;
  scratch.query_bits.resize(tiles * 16 * HD);
  scratch.key_pairs.resize(kSpans * 16 * 16);
  uint16_t* query_bits = scratch.query_bits.data();
  // The last tile's rows past `count`: zeros (their scores are never read).
  std::memset(query_bits + count * HD, 0, (tiles * 16 - count) * HD * sizeof(uint16_t));
  uint32_t* key_pairs = scratch.key_pairs.data();
  const uint16_t* q = static_cast<const uint16_t*>(problem.q);
  for (int64_t j = 0; j < num_nodes; ++j) {  // the group's heads are side by side in q
    std::memcpy(query_bits + j * group * HD,
                q + ((s * num_nodes + j) * problem.heads + g * group) * HD,
                group * HD * sizeof(uint16_t));
  }
  _tile_loadconfig(&kTiles16x64);
  for (int64_t p0 = 0; p0 < length; p0 += 16) {
    pack_key_pairs<HD>(keys, p0, length, key_pairs);
    for (int64_t t = 0; t < tiles; ++t) {
      _tile_zero(0);
      for (int64_t span = 0; span < kSpans; ++span) {
        _tile_loadd(1, query_bits + t * 16 * HD + span * 32, HD * sizeof(uint16_t));
        _tile_loadd(2, key_pairs + span * 16 * 16, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, scores + t * 16 * stride + p0, stride * sizeof(float));
    }
  }
  _tile_release();
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

// Pass 1 with AVX-512 BF16's dot products: scores[i * stride + p] = <query i, key p> (unscaled)
// for the `count` bfloat16 queries of key head g of row s (node-major, as in attend) and keys
// [0, length). The queries are laid out once as [HD / 2][16 v + lane] pairs of dimensions; per
// sixteen queries and sixteen keys, each pair r adds q[2r] k[2r] + q[2r + 1] k[2r + 1] to the
// sixteen queries' sums of one key (VDPBF16PS, that key's pair broadcast), pairs in order. A
// last block past `length` reads zero keys (its scores are never read).
template <int64_t HD>
void scores_dpbf16(const AttentionProblem& problem, int64_t s, int64_t g, const uint16_t* keys,
                   int64_t length, int64_t stride, float* scores, Scratch& scratch) {
  constexpr int64_t kPairs = HD / 2;
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t count = group * num_nodes;
  const int64_t vectors = (count + 15) / 16, lanes = 16 * vectors;
  scratch.query_pairs.assign(kPairs * lanes, 0u);
  uint32_t* query_pairs = scratch.query_pairs.data();
  const auto* q = static_cast<const uint32_t*>(problem.q);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = i / group, k = i % group;
    const uint32_t* row = q + ((s * num_nodes + j) * problem.heads + g * group + k) * kPairs;
    for (int64_t r = 0; r < kPairs; ++r) query_pairs[r * lanes + i] = row[r];
  }
  const auto* key_pairs = reinterpret_cast<const uint32_t*>(keys);
  scratch.last_keys.resize(16 * kPairs);
  for (int64_t p0 = 0; p0 < length; p0 += 16) {
    const uint32_t* block = key_pairs + p0 * kPairs;
    if (p0 + 16 > length) {  // the last, partial block: copied beside zero keys
      std::fill(scratch.last_keys.begin(), scratch.last_keys.end(), 0u);
      std::memcpy(scratch.last_keys.data(), block, (length - p0) * kPairs * sizeof(uint32_t));
      block = scratch.last_keys.data();
    }
    for (int64_t v = 0; v < vectors; ++v) {
      __m512 acc[16];
      for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
      const uint32_t* queries = query_pairs + 16 * v;
      for (int64_t r = 0; r < kPairs; ++r) {
        const __m512bh query = (__m512bh)_mm512_loadu_si512(queries + r * lanes);
        for (int k = 0; k < 16; ++k) {
          const __m512bh key = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(block[k * kPairs + r]));
          acc[k] = _mm512_dpbf16_ps(acc[k], query, key);
        }
      }
      transpose16(acc);  // acc[i]: query 16 v + i's scores of the sixteen keys
      const int64_t rows = std::min<int64_t>(16, count - 16 * v);
      for (int64_t i = 0; i < rows; ++i) {
        _mm512_storeu_ps(scores + (16 * v + i) * stride + p0, acc[i]);
      }
    }
  }
}

// Pass 3 for queries [first, first + QT), dimensions [d0, d0 + DIMS) of the head (values and
// result point at d0; their rows HD apart): out = sum_p w_p v_p / sum_p w_p. Each output
// element is one sum over the positions in order, whatever QT and DIMS.
template <typename T, int64_t HD, int64_t QT, int64_t DIMS>
inline void weigh_values(const float* weights, int64_t stride, const T* values, int64_t length,
                         float* result) {
  constexpr int64_t kChunks = DIMS / 16;
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

// weigh_values for QT queries over the whole head, kSliceDims dimensions at a time: six
// queries' accumulators of 64 dimensions (24 registers) beside one position's 64 values (4),
// so a position's values are loaded and widened once per six queries (with 128 dimensions at
// once only two queries fit beside them).
constexpr int64_t kSliceDims = 64;
constexpr int64_t kQueryTile = 6;

template <typename T, int64_t HD, int64_t QT>
inline void weigh_tile(const float* weights, int64_t stride, const T* values, int64_t length,
                       float* result) {
  static_assert(HD % kSliceDims == 0, "heads of a multiple of 64 dimensions");
  for (int64_t d0 = 0; d0 < HD; d0 += kSliceDims) {
    weigh_values<T, HD, QT, kSliceDims>(weights, stride, values + d0, length, result + d0);
  }
}

// Pass 3 for `count` queries of key head g, node-major (query i: token first_token + i / group,
// query head g * group + i % group), their weights rows of `scores` `stride` apart over keys
// [0, length): out = the weighted values, a tile of queries at a time, in the model's dtype.
template <typename T, int64_t HD>
void weigh_and_store(const AttentionProblem& problem, int64_t g, const float* scores,
                     int64_t stride, int64_t count, const T* values, int64_t length,
                     int64_t first_token) {
  const int64_t group = problem.group();
  float result[kQueryTile * HD];
  const auto write = [&](int64_t first, int64_t tile) {
    for (int64_t t = 0; t < tile; ++t) {
      const int64_t query = first + t, j = query / group, k = query % group;
      store_row(result + t * HD, HD, problem.dtype, problem.out,
                ((first_token + j) * problem.heads + g * group + k) * HD);
    }
  };
  int64_t i = 0;
  for (; i + kQueryTile <= count; i += kQueryTile) {
    weigh_tile<T, HD, kQueryTile>(scores + i * stride, stride, values, length, result);
    write(i, kQueryTile);
  }
  const float* rest = scores + i * stride;
  switch (count - i) {  // the last 1-5 queries as one tile
    case 5: weigh_tile<T, HD, 5>(rest, stride, values, length, result); break;
    case 4: weigh_tile<T, HD, 4>(rest, stride, values, length, result); break;
    case 3: weigh_tile<T, HD, 3>(rest, stride, values, length, result); break;
    case 2: weigh_tile<T, HD, 2>(rest, stride, values, length, result); break;
    case 1: weigh_tile<T, HD, 1>(rest, stride, values, length, result); break;
    default: return;
  }
  write(i, count - i);
}

template <typename T, int64_t HD>
void attend(const AttentionProblem& problem, int64_t s, int64_t g) {
  constexpr int64_t kChunks = HD / 16;
  thread_local Scratch scratch;
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t count = group * num_nodes;  // queries, node-major: i = j * group + k
  const int64_t cached = problem.cache_lens[s];
  const int64_t length = cached + num_nodes;  // keys: the cache, then the step's nodes
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
  const int64_t offset = problem.cache_offset(s, g);
  const T* keys = static_cast<const T*>(problem.key_cache) + offset;
  const T* values = static_cast<const T*>(problem.value_cache) + offset;
  const __m512 scale = _mm512_set1_ps(problem.scale);

  // 1. Scores, sixteen keys at a time (on the tile unit or with the dot products: scaled in
  // pass 2).
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    if (amx) scores_amx<HD>(problem, s, g, keys, length, stride, scores, scratch);
    if (dpbf16) scores_dpbf16<HD>(problem, s, g, keys, length, stride, scores, scratch);
  }
  for (int64_t p0 = 0; vector_scores && p0 < length; p0 += 16) {
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
    if (!vector_scores) {
      for (int64_t p = 0; p < length; p += 16) {
        _mm512_storeu_ps(row + p, _mm512_mul_ps(_mm512_loadu_ps(row + p), scale));
      }
    }
    for (int64_t t = 0; t < num_nodes; ++t) {
      if (!problem.visible(s, j, cached + t)) row[cached + t] = -INFINITY;
    }
    for (int64_t p = length; p < stride; ++p) row[p] = -INFINITY;
    exp_from_maximum(row, stride);
  }

  // 3. Values, then the output in the model's dtype.
  weigh_and_store<T, HD>(problem, g, scores, stride, count, values, length, s * num_nodes);
}

// --- prompts -----------------------------------------------------------------------------------
//
// Causal attention of a whole prompt (prompt_attention). A work item is a block of query
// positions of one key head, its group's query heads beside each other: about kPromptRows query
// rows that share every key. Its scores are tiles of kScoreRows queries against 32 keys, each
// key block transposed once per call into [head_dim][16] float32, so a tile multiplies one
// query element, broadcast, by the same element of sixteen keys: no reduction across lanes, and
// each key element loaded once per tile of queries. Then the causal mask, the softmax and the
// values as for a tree (the same exp16 and weigh_values); the keys a query does not see weigh
// exactly 0. Items run on the OpenMP threads, the longest (last positions) first.
// In bfloat16 on CPUs with AMX the scores run on the tile unit instead (prompt_scores_amx):
// the keys packed once per call into the tile layout of pairs, a tile of 16 query rows held in
// the tile registers while every key block passes (at 2,000 tokens 1.3-1.5x faster a layer
// than the vector loop, bench numbers in docs/services/verifier.md). A score stays a function
// of its query and key, so a position's result still does not depend on the prompt's length.

constexpr int64_t kPromptRows = 96;
constexpr int64_t kScoreRows = 8;

// Positions [first, first + 16) of one key head's keys [length, HD] as float32 [HD][16]; a
// position at or past `length` as zeros.
template <typename T, int64_t HD>
void transpose_keys(const T* keys, int64_t first, int64_t length, float* out) {
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                            5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
  for (int64_t k = 0; k < 16; ++k) {
    const int64_t position = first + k;
    for (int64_t c = 0; c < HD; c += 16) {
      const __m512 element = position < length ? load16<T>(keys + position * HD + c)
                                               : _mm512_setzero_ps();
      _mm512_i32scatter_ps(out + c * 16 + k, lanes, element, 4);
    }
  }
}

// scores[r][16 b + lane] = scale * <query r, key lane of block b> for R queries [R][HD] and KB
// transposed key blocks (consecutive, [HD][16] each).
template <int64_t HD, int64_t R, int64_t KB>
inline void score_tile(const float* queries, const float* blocks, float* scores, int64_t stride,
                       __m512 scale) {
  __m512 acc[R][KB];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t b = 0; b < KB; ++b) acc[r][b] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < HD; ++c) {
    __m512 key[KB];
    for (int64_t b = 0; b < KB; ++b) key[b] = _mm512_loadu_ps(blocks + b * HD * 16 + c * 16);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 query = _mm512_set1_ps(queries[r * HD + c]);
      for (int64_t b = 0; b < KB; ++b) acc[r][b] = _mm512_fmadd_ps(query, key[b], acc[r][b]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t b = 0; b < KB; ++b) {
      _mm512_storeu_ps(scores + r * stride + b * 16, _mm512_mul_ps(acc[r][b], scale));
    }
  }
}

template <int64_t HD, int64_t R>
inline void score_rows(const float* queries, const float* blocks, int64_t num_blocks,
                       float* scores, int64_t stride, __m512 scale) {
  int64_t b = 0;
  for (; b + 2 <= num_blocks; b += 2) {
    score_tile<HD, R, 2>(queries, blocks + b * HD * 16, scores + b * 16, stride, scale);
  }
  if (b < num_blocks) {
    score_tile<HD, R, 1>(queries, blocks + b * HD * 16, scores + b * 16, stride, scale);
  }
}

// A prompt block's scores on the AMX tile unit: scores[i * stride + p] = <query i, key p>
// (unscaled) for the `count` bfloat16 queries of `query_bits` (rows HD apart, padded with zero
// rows to a multiple of 16) and the key blocks [0, num_blocks) of `pairs` (pack_key_pairs).
// A tile of 16 queries stays in tiles 2-5 (one per 32 dimensions) while the key blocks pass:
// per 16 x 16 scores, one tile load and one TDPBF16PS per 32 dimensions, summed in tile 0. As
// in the tree's scores_amx, a score is a function of its query and its key alone.
template <int64_t HD>
void prompt_scores_amx(const uint16_t* query_bits, int64_t count, const uint32_t* pairs,
                       int64_t num_blocks, float* scores, int64_t stride) {
  constexpr int64_t kSpans = HD / 32;
  static_assert(kSpans == 2 || kSpans == 4, "heads of 64 or 128");
  constexpr int64_t kBlock = HD / 2 * 16;  // uint32 per packed block of 16 keys
  constexpr int kRow = HD * sizeof(uint16_t);
  _tile_loadconfig(&kTiles16x64);
  const int64_t tiles = (count + 15) / 16;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint16_t* rows = query_bits + t * 16 * HD;
    _tile_loadd(2, rows, kRow);
    _tile_loadd(3, rows + 32, kRow);
    if constexpr (kSpans == 4) {
      _tile_loadd(4, rows + 64, kRow);
      _tile_loadd(5, rows + 96, kRow);
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint32_t* block = pairs + b * kBlock;
      _tile_zero(0);
      _tile_loadd(6, block, 64);
      _tile_dpbf16ps(0, 2, 6);
      _tile_loadd(7, block + 256, 64);
      _tile_dpbf16ps(0, 3, 7);
      if constexpr (kSpans == 4) {
        _tile_loadd(6, block + 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, block + 768, 64);
        _tile_dpbf16ps(0, 5, 7);
      }
      _tile_stored(0, scores + t * 16 * stride + b * 16,
                   stride * static_cast<int64_t>(sizeof(float)));
    }
  }
  _tile_release();
}

// Query positions [first, first + count) of key head g; `blocks`: its keys, transposed, or,
// for scores on the tile unit, `pairs`: its keys packed by pack_key_pairs (else null).
template <typename T, int64_t HD>
void attend_prompt_block(const AttentionProblem& problem, int64_t g, int64_t first,
                         int64_t num_positions, const float* blocks, const uint32_t* pairs) {
  thread_local Scratch scratch;
  const int64_t group = problem.group(), heads = problem.heads;
  const int64_t count = group * num_positions;  // query rows, position-major: i = j * group + k
  const int64_t end = first + num_positions;  // keys [0, end) serve every row of the block
  const int64_t stride = (end + 15) / 16 * 16;
  const int64_t num_blocks = stride / 16;
  const bool amx = pairs != nullptr;
  const int64_t padded = amx ? (count + 15) / 16 * 16 : count;  // whole tiles of queries
  scratch.scores.resize(padded * stride);
  float* scores = scratch.scores.data();
  const T* q = static_cast<const T*>(problem.q);
  const __m512 scale = _mm512_set1_ps(problem.scale);
  if constexpr (sizeof(T) == sizeof(uint16_t)) {
    if (amx) {
      scratch.query_bits.resize(padded * HD);
      uint16_t* bits = scratch.query_bits.data();
      for (int64_t j = 0; j < num_positions; ++j) {  // the group's heads, together
        std::memcpy(bits + j * group * HD, q + ((first + j) * heads + g * group) * HD,
                    group * HD * sizeof(uint16_t));
      }
      std::memset(bits + count * HD, 0, (padded - count) * HD * sizeof(uint16_t));
      prompt_scores_amx<HD>(bits, count, pairs, num_blocks, scores, stride);
    }
  }
  if (!amx) {
    scratch.queries.resize(count * HD);
    float* queries = scratch.queries.data();
    for (int64_t j = 0; j < num_positions; ++j) {
      const T* source = q + ((first + j) * heads + g * group) * HD;  // the group's heads
      for (int64_t e = 0; e < group * HD; e += 16) {
        _mm512_storeu_ps(queries + j * group * HD + e, load16<T>(source + e));
      }
    }
    int64_t i = 0;
    for (; i + kScoreRows <= count; i += kScoreRows) {
      score_rows<HD, kScoreRows>(queries + i * HD, blocks, num_blocks, scores + i * stride,
                                 stride, scale);
    }
    for (; i < count; ++i) {
      score_rows<HD, 1>(queries + i * HD, blocks, num_blocks, scores + i * stride, stride,
                        scale);
    }
  }
  for (int64_t i = 0; i < count; ++i) {  // (scale,) causal mask, maximum, exp
    float* row = scores + i * stride;
    const int64_t seen = first + i / group + 1;
    if (amx) {
      for (int64_t p = 0; p < seen; p += 16) {
        _mm512_storeu_ps(row + p, _mm512_mul_ps(_mm512_loadu_ps(row + p), scale));
      }
    }
    for (int64_t p = seen; p < stride; ++p) row[p] = -INFINITY;
    exp_from_maximum(row, stride);
  }
  const T* values = static_cast<const T*>(problem.value_cache) + problem.cache_offset(0, g);
  weigh_and_store<T, HD>(problem, g, scores, stride, count, values, end, first);
}

template <typename T, int64_t HD>
void attend_prompt(const AttentionProblem& problem) {
  const int64_t length = problem.num_nodes, kv_heads = problem.kv_heads;
  const int64_t positions = std::max<int64_t>(1, kPromptRows / problem.group());
  const int64_t num_key_blocks = (length + 15) / 16;
  const int64_t num_query_blocks = (length + positions - 1) / positions;
  // Scores on the tile unit (bfloat16, problem.amx) read the keys packed in pairs
  // (pack_key_pairs), else the vector loop reads them transposed into float32. The calling
  // thread's buffers, shared with the team by these pointers (a thread_local named inside the
  // parallel region would be each thread's own).
  const bool amx = sizeof(T) == sizeof(uint16_t) && problem.amx;
  thread_local std::vector<float> transposed;
  thread_local std::vector<uint32_t> packed;
  if (amx) {
    packed.resize(kv_heads * num_key_blocks * HD / 2 * 16);
  } else {
    transposed.resize(kv_heads * num_key_blocks * HD * 16);
  }
  float* const blocks = transposed.data();
  uint32_t* const pairs = packed.data();
  const T* keys = static_cast<const T*>(problem.key_cache);
  const int64_t key_items = kv_heads * num_key_blocks;
  const int64_t query_items = kv_heads * num_query_blocks;
#pragma omp parallel if (query_items > 1)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < key_items; ++item) {
      const int64_t g = item / num_key_blocks, b = item % num_key_blocks;
      if constexpr (sizeof(T) == sizeof(uint16_t)) {
        if (amx) {
          pack_key_pairs<HD>(keys + problem.cache_offset(0, g), 16 * b, length,
                             pairs + item * HD / 2 * 16);
          continue;
        }
      }
      transpose_keys<T, HD>(keys + problem.cache_offset(0, g), 16 * b, length,
                            blocks + item * HD * 16);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < query_items; ++item) {
      const int64_t g = item % kv_heads, block = num_query_blocks - 1 - item / kv_heads;
      const int64_t first = block * positions;
      attend_prompt_block<T, HD>(
          problem, g, first, std::min(positions, length - first),
          amx ? nullptr : blocks + g * num_key_blocks * HD * 16,
          amx ? pairs + g * num_key_blocks * HD / 2 * 16 : nullptr);
    }
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

bool prompt_attention_avx512(const AttentionProblem& problem) {
  const bool is_float = problem.dtype == Dtype::kFloat32;
  switch (problem.head_dim) {
    case 64:
      is_float ? attend_prompt<float, 64>(problem) : attend_prompt<uint16_t, 64>(problem);
      return true;
    case 128:
      is_float ? attend_prompt<float, 128>(problem) : attend_prompt<uint16_t, 128>(problem);
      return true;
    default:
      return false;
  }
}

}  // namespace sssd::kernels::detail
