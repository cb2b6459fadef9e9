// The tree attention's scores with AVX-512 BF16's dot products, in bfloat16, where cpu_paths.h
// chooses them (CPUs with AVX-512 BF16 and no AMX, AMD Zen 4 and later): lanes are sixteen
// queries, one instruction adds a pair of dimensions of one key (broadcast) to all sixteen
// scores, and sixteen keys' scores are transposed into rows at the end. A score is the sum over
// the head's pairs of dimensions, in order, of its query's and key's products: a function of the
// two alone. The vector loop reloads every query and key element per score and folds sixteen
// partial sums; here a key's pair is read once per sixteen queries and a query's once per
// sixteen keys.
//
// Compiled with -mavx512bf16 and AVX-512 (CMakeLists.txt); called only where the CPU has
// them (cpu_paths.h).
#include <cstring>

#include "attention_avx512.h"

namespace sssd::kernels::detail {
namespace {

// Pass 1 with AVX-512 BF16's dot products: scores[i * stride + p] = <query i, key p> (unscaled)
// for the `count` bfloat16 queries of key head g of row s (node-major) and keys
// [0, length). The queries are laid out once as [HD / 2][16 v + lane] pairs of dimensions; per
// sixteen queries and sixteen keys, each pair r adds q[2r] k[2r] + q[2r + 1] k[2r + 1] to the
// sixteen queries' sums of one key (VDPBF16PS, that key's pair broadcast), pairs in order. A
// last block past `length` reads zero keys (its scores are never read).
template <int64_t HD>
void tree_scores(const AttentionProblem& problem, int64_t s, int64_t g, const PagedHead& head,
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
  scratch.last_keys.resize(16 * kPairs);
  for (int64_t p0 = 0; p0 < length; p0 += 16) {
    prefetch_keys<uint16_t, HD>(head, p0, length);
    const auto* block = reinterpret_cast<const uint32_t*>(head.key<uint16_t>(p0));
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

}  // namespace

bool scores_dpbf16(const AttentionProblem& problem, int64_t s, int64_t g,
                   const PagedHead& head, int64_t length, int64_t stride, float* scores,
                   Scratch& scratch) {
  switch (problem.head_dim) {
    case 64: tree_scores<64>(problem, s, g, head, length, stride, scores, scratch); return true;
    case 128: tree_scores<128>(problem, s, g, head, length, stride, scores, scratch); return true;
    default: return false;
  }
}

}  // namespace sssd::kernels::detail
