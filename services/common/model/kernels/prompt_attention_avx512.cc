// Causal attention of a prompt, or of a chunk of one, with AVX-512: query j of the chunk (at
// position start + j, after the row's `start` cached positions) sees keys 0 .. start + j. A work
// item is a block of query positions of one key head, its group's query heads beside each
// other: about kPromptRows query rows that share every key. Its scores are tiles of kScoreRows
// queries against 32 keys, each key block transposed once per call into [head_dim][16] float32,
// so a tile multiplies one query element, broadcast, by the same element of sixteen keys: no
// reduction across lanes, and each key element loaded once per tile of queries. In bfloat16 on
// CPUs with AMX the scores run on the tile unit instead (attention_scores_amx.cc): the keys
// packed once per call into the tile layout of pairs, a tile of 16 query rows held in the tile
// registers while every key block passes. Then the causal mask, the softmax and the values as
// for a tree (attention_avx512.h); the keys a query does not see weigh exactly 0, and a score
// is a function of its query and its key, so a position's result does not depend on the
// prompt's length, on how it was cut into chunks, or on the cache's blocks. Items run on the
// OpenMP threads, the longest (last positions) first; scratch memory is per work item, never
// the square of the prompt.
//
// Compiled with -mavx512f and its BW, DQ, VL extensions (CMakeLists.txt); called only where the
// CPU has them.
#include <cstring>

#include "attention_avx512.h"

namespace sssd::kernels::detail {
namespace {

constexpr int64_t kPromptRows = 96;
constexpr int64_t kScoreRows = 8;

// Positions [first, first + 16) of one key head's keys (`keys`: position `first`, the next 15
// following it in its block) as float32 [HD][16]; a position at or past `length` as zeros.
template <typename T, int64_t HD>
void transpose_keys(const T* keys, int64_t first, int64_t length, float* out) {
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                            5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
  for (int64_t k = 0; k < 16; ++k) {
    const int64_t position = first + k;
    for (int64_t c = 0; c < HD; c += 16) {
      const __m512 element = position < length ? load16<T>(keys + k * HD + c)
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

// Query positions [first, first + num_positions) of the chunk, key head g (keys [0, start +
// first + num_positions) of `head`); `blocks`: its keys, transposed, or, for scores on the tile
// unit, `pairs`: its keys packed by pack_key_pairs (else null).
template <typename T, int64_t HD>
void attend_prompt_block(const AttentionProblem& problem, int64_t g, int64_t first,
                         int64_t num_positions, const float* blocks, const uint32_t* pairs,
                         const PagedHead& head) {
  thread_local Scratch scratch;
  const int64_t group = problem.group(), heads = problem.heads;
  const int64_t start = problem.cache_lens[0];
  const int64_t count = group * num_positions;  // query rows, position-major: i = j * group + k
  const int64_t end = start + first + num_positions;  // keys [0, end) serve every row
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
      prompt_scores_amx(bits, count, pairs, num_blocks, HD, scores, stride);
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
    const int64_t seen = start + first + i / group + 1;
    if (amx) {
      for (int64_t p = 0; p < seen; p += 16) {
        _mm512_storeu_ps(row + p, _mm512_mul_ps(_mm512_loadu_ps(row + p), scale));
      }
    }
    for (int64_t p = seen; p < stride; ++p) row[p] = -INFINITY;
    exp_from_maximum(row, stride);
  }
  weigh_and_store<T, HD>(problem, g, scores, stride, count, head, end, first);
}

template <typename T, int64_t HD>
void attend_prompt(const AttentionProblem& problem) {
  const int64_t length = problem.cache_lens[0] + problem.num_nodes;  // every key of the chunk
  const int64_t kv_heads = problem.kv_heads;
  const int64_t positions = std::max<int64_t>(1, kPromptRows / problem.group());
  const int64_t num_key_blocks = (length + 15) / 16;
  const int64_t num_query_blocks = (problem.num_nodes + positions - 1) / positions;
  // Scores on the tile unit (bfloat16, problem.amx) read the keys packed in pairs
  // (pack_key_pairs), else the vector loop reads them transposed into float32. The calling
  // thread's buffers, shared with the team by these pointers (a thread_local named inside the
  // parallel region would be each thread's own).
  const bool amx = sizeof(T) == sizeof(uint16_t) && problem.amx;
  thread_local std::vector<float> transposed;
  thread_local std::vector<uint32_t> packed;
  thread_local std::vector<Scratch> heads_scratch;
  thread_local std::vector<PagedHead> heads;
  if (amx) {
    packed.resize(kv_heads * num_key_blocks * HD / 2 * 16);
  } else {
    transposed.resize(kv_heads * num_key_blocks * HD * 16);
  }
  heads_scratch.resize(kv_heads);
  heads.clear();
  for (int64_t g = 0; g < kv_heads; ++g) {
    heads.push_back(paged_head(problem, 0, g, length, heads_scratch[g]));
  }
  float* const blocks = transposed.data();
  uint32_t* const pairs = packed.data();
  const PagedHead* const paged = heads.data();
  const int64_t key_items = kv_heads * num_key_blocks;
  const int64_t query_items = kv_heads * num_query_blocks;
#pragma omp parallel if (query_items > 1)
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < key_items; ++item) {
      const int64_t g = item / num_key_blocks, b = item % num_key_blocks;
      const T* keys = paged[g].key<T>(16 * b);
      if constexpr (sizeof(T) == sizeof(uint16_t)) {
        if (amx) {
          pack_key_pairs(keys, 16 * b, length, HD, pairs + item * HD / 2 * 16);
          continue;
        }
      }
      transpose_keys<T, HD>(keys, 16 * b, length, blocks + item * HD * 16);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < query_items; ++item) {
      const int64_t g = item % kv_heads, block = num_query_blocks - 1 - item / kv_heads;
      const int64_t first = block * positions;
      attend_prompt_block<T, HD>(
          problem, g, first, std::min(positions, problem.num_nodes - first),
          amx ? nullptr : blocks + g * num_key_blocks * HD * 16,
          amx ? pairs + g * num_key_blocks * HD / 2 * 16 : nullptr, paged[g]);
    }
  }
}

}  // namespace

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
