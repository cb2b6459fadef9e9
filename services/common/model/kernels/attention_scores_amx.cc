// Attention scores on the AMX tile unit, in bfloat16, where cpu_paths.h chooses it (CPUs with
// AMX): a tile of 16 queries times 16 keys per instruction over 32 of the head's dimensions,
// where the vector loop spends a dot product per query and key. A score is still a function of
// its query and its key alone (each output of TDPBF16PS is its row of the one tile times its
// column of the other), so a query's result still depends only on the keys it sees; the scores
// differ from the vector loop's in the order of their sums. Pass 3 stays on the vector units
// (attention_avx512.h says why).
//
// Compiled with -mamx-tile -mamx-bf16 and AVX-512 (CMakeLists.txt); called only where the CPU
// and its OS offer the tiles (cpu_paths.h).
#include <cstring>

#include "amx_tiles.h"
#include "attention_avx512.h"

namespace sssd::kernels::detail {
namespace {

// The tree attention's pass 1 on the AMX tile unit, key-major: for each tile of 16
// queries t, scores[((t * stride) + p) * 16 + lane] = <query 16 t + lane, key p> (unscaled) for
// the `count` queries of key head g of row s (node-major) and keys [0, length). Sixteen keys are
// a tile as the cache holds them (key m's 32 dimensions of a span in row m, rows a key apart), and
// sixteen queries a tile laid out once per call as pairs (row r: the dimensions 2r and 2r + 1 of
// each query side by side), so each product is a tile of 16 keys x 16 queries, stored as it is:
// the keys are neither rearranged nor the scores transposed. A block's keys past `length` are
// whatever their slots hold: each score is its key's and query's product alone, and pass 2
// gives those positions -inf. Lanes past `count` hold zero queries' scores, never read. Tiles
// (kTiles16x64): tmm0 the 16 keys x 16 queries (float32), tmm1 16 keys x 32 dimensions, tmm2
// 16 pairs of dimensions x 16 queries x 2 (bfloat16).
template <int64_t HD>
void tree_scores(const AttentionProblem& problem, int64_t s, int64_t g, const PagedHead& head,
                 int64_t length, int64_t stride, float* scores, Scratch& scratch) {
  constexpr int64_t kSpans = HD / 32;  // 32 dimensions (64 bytes) per tile row
  constexpr int64_t kTileWords = 16 * 16;  // 32-bit words of a tile
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t count = group * num_nodes;
  const int64_t tiles = (count + 15) / 16;
  // query_pairs[t][span][r][lane]: the pair r of the span's dimensions of query 16 t + lane
  // (lanes past `count` zero): the 16 queries' pairs of a span, one vector each, transposed.
  scratch.query_pairs.resize(tiles * kSpans * kTileWords);
  float* query_pairs = reinterpret_cast<float*>(scratch.query_pairs.data());
  const auto* q = static_cast<const uint32_t*>(problem.q);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t span = 0; span < kSpans; ++span) {
      __m512 pairs[16];
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t i = 16 * t + lane, j = i / group, k = i % group;
        pairs[lane] = i < count ? _mm512_loadu_ps(q + ((s * num_nodes + j) * problem.heads +
                                                       g * group + k) * (HD / 2) + 16 * span)
                                : _mm512_setzero_ps();
      }
      transpose16(pairs);  // moves bits only: pairs[r], lane k: query 16 t + k's pair r
      float* tile = query_pairs + (t * kSpans + span) * kTileWords;
      for (int64_t r = 0; r < 16; ++r) _mm512_storeu_ps(tile + 16 * r, pairs[r]);
    }
  }
  _tile_loadconfig(&kTiles16x64);
  for (int64_t p0 = 0; p0 < length; p0 += 16) {
    prefetch_keys<uint16_t, HD>(head, p0, length);
    const uint16_t* keys = head.key<uint16_t>(p0);
    for (int64_t t = 0; t < tiles; ++t) {
      _tile_zero(0);
      for (int64_t span = 0; span < kSpans; ++span) {
        _tile_loadd(1, keys + span * 32, HD * sizeof(uint16_t));
        _tile_loadd(2, query_pairs + (t * kSpans + span) * kTileWords, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, scores + (t * stride + p0) * 16, 64);
    }
  }
  _tile_release();
}

}  // namespace

bool scores_amx(const AttentionProblem& problem, int64_t s, int64_t g, const PagedHead& head,
                int64_t length, int64_t stride, float* scores, Scratch& scratch) {
  switch (problem.head_dim) {
    case 64: tree_scores<64>(problem, s, g, head, length, stride, scores, scratch); return true;
    case 128: tree_scores<128>(problem, s, g, head, length, stride, scores, scratch); return true;
    default: return false;
  }
}

}  // namespace sssd::kernels::detail
