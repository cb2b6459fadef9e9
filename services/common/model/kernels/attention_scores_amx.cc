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

template <int64_t HD>
void pack_pairs(const uint16_t* keys, int64_t first, int64_t length, uint32_t* out) {
  const int64_t block = std::max<int64_t>(0, std::min<int64_t>(16, length - first));
  const __mmask16 present = static_cast<__mmask16>((1u << block) - 1u);
  const __m512i key_starts = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(HD / 2));
  const void* base = keys;  // position `first`
  for (int64_t pair = 0; pair < HD / 2; ++pair) {
    _mm512_storeu_si512(out + pair * 16, _mm512_mask_i32gather_epi32(
        _mm512_setzero_si512(), present,
        _mm512_add_epi32(key_starts, _mm512_set1_epi32(static_cast<int>(pair))), base, 4));
  }
}

// The tree attention's pass 1 on the AMX tile unit: scores[i * stride + p] = <query i, key p>
// (unscaled) for the `count` queries of key head g of row s (node-major) and keys [0, length);
// queries past `count` (up to a multiple of 16) get rows of their own, which the caller sizes.
// A block of 16 keys is rearranged once into the tile layout of pairs (dimensions 2r and
// 2r + 1 of each key side by side); a key past `length` as zeros. Tiles (kTiles16x64): tmm0
// the scores of 16 queries x 16 keys (float32), tmm1 16 queries x 32 dimensions (bfloat16),
// tmm2 16 pairs of dimensions x 16 keys x 2 (bfloat16).
template <int64_t HD>
void tree_scores(const AttentionProblem& problem, int64_t s, int64_t g, const PagedHead& head,
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
    pack_pairs<HD>(head.key<uint16_t>(p0), p0, length, key_pairs);
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
