// The attention entry point (kernels.h): the checks, the path cpu_paths.h chooses (the AVX-512
// or AVX2 tree attention, or the portable loop below), and the work split over the OpenMP
// threads by (row, key head).
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_paths.h"
#include "kernels.h"
#include "rows.h"

namespace sssd::kernels {
namespace {

using detail::AttentionProblem;
using detail::add_scaled;
using detail::dot;
using detail::exp_nonpositive;
using detail::from_float;
using detail::to_float;

// The portable attention of one (row, key head) pair, for CPUs without AVX-512 or AVX2: for each
// query (node j, query head k of the group), the same sums in the same order as the AVX-512 one
// (tree_attention_avx512.cc) up to the order within a dot product: scores over the visible keys,
// their maximum, then the weights and the weighted values added in key order. Each key and
// value is widened to float32 once for all the group's queries and nodes that see it.
void attend_portable(const AttentionProblem& problem, int64_t s, int64_t g) {
  const int64_t group = problem.group(), num_nodes = problem.num_nodes;
  const int64_t head_dim = problem.head_dim;
  const int64_t length = problem.cache_lens[s] + num_nodes;
  const int64_t queries = num_nodes * group;  // query i: node i / group, head g * group + i % group
  std::vector<float> query(queries * head_dim), row(head_dim), scores(queries * length),
      top(queries, -INFINITY), total(queries, 0.0f), result(queries * head_dim, 0.0f);
  const auto q_offset = [&](int64_t i) {
    return ((s * num_nodes + i / group) * problem.heads + g * group + i % group) * head_dim;
  };
  for (int64_t i = 0; i < queries; ++i) {
    to_float(problem.q, q_offset(i), head_dim, problem.dtype, query.data() + i * head_dim);
  }
  for (int64_t p = 0; p < length; ++p) {
    bool widened = false;
    for (int64_t j = 0; j < num_nodes; ++j) {
      const bool visible = problem.visible(s, j, p);
      if (visible && !widened) {
        to_float(problem.key_cache, problem.offset(s, g, p), head_dim, problem.dtype,
                 row.data());
        widened = true;
      }
      for (int64_t i = j * group; i < (j + 1) * group; ++i) {
        float& score = scores[i * length + p];
        score = visible ? dot(query.data() + i * head_dim, row.data(), head_dim) * problem.scale
                        : -INFINITY;
        top[i] = std::max(top[i], score);
      }
    }
  }
  for (int64_t p = 0; p < length; ++p) {
    bool widened = false;
    for (int64_t i = 0; i < queries; ++i) {
      const float weight = exp_nonpositive(scores[i * length + p] - top[i]);
      if (weight == 0.0f) continue;
      if (!widened) {
        to_float(problem.value_cache, problem.offset(s, g, p), head_dim, problem.dtype,
                 row.data());
        widened = true;
      }
      total[i] += weight;
      add_scaled(result.data() + i * head_dim, weight, row.data(), head_dim);
    }
  }
  for (int64_t i = 0; i < queries; ++i) {
    float* out = result.data() + i * head_dim;
    const float inverse = 1.0f / total[i];
    for (int64_t d = 0; d < head_dim; ++d) out[d] *= inverse;
    from_float(out, head_dim, problem.dtype, problem.out, q_offset(i));
  }
}

// The checks every entry point makes (the rows' block tables were checked against the cache
// when they were made: check_rows), and the problem of `layer` for these rows.
AttentionProblem problem_of(const KvLayout& cache, int64_t layer, const StepRows& rows,
                            const void* q, void* out, int64_t heads, float scale,
                            const char* name) {
  const std::string where(name);
  if (layer < 0 || layer >= cache.num_layers()) {
    throw std::invalid_argument(where + ": layer " + std::to_string(layer) + " of " +
                                std::to_string(cache.num_layers()));
  }
  if (cache.kv_heads < 1 || heads % cache.kv_heads != 0 || cache.head_dim % 2 != 0) {
    throw std::invalid_argument(where + ": heads must be a multiple of kv_heads");
  }
  return AttentionProblem{q, out, reinterpret_cast<const void*>(cache.keys[layer]),
                          reinterpret_cast<const void*>(cache.values[layer]), rows.block_tables,
                          rows.cache_lens, rows.tree_bits, rows.max_blocks, cache.block_size,
                          rows.num_seqs, rows.num_nodes, heads, cache.kv_heads, cache.head_dim,
                          scale, cache.dtype};
}

}  // namespace

void attention(const KvLayout& cache, int64_t layer, const StepRows& rows, const void* q,
               void* out, int64_t heads, float scale) {
  if (rows.num_nodes < 1 || rows.num_nodes > kMaxTreeNodes || rows.tree_bits == nullptr) {
    throw std::invalid_argument("attention: 1 to 64 nodes per row, with their tree bits");
  }
  AttentionProblem problem = problem_of(cache, layer, rows, q, out, heads, scale, "attention");
  const Path path = path_of(Kernel::kTreeAttention, cache.dtype);
  const Path scores = path_of(Kernel::kAttentionScores, cache.dtype);
  problem.amx = path == Path::kAvx512 && scores == Path::kAmx;
  problem.dpbf16 = path == Path::kAvx512 && scores == Path::kDpbf16;
  const int64_t items = rows.num_seqs * cache.kv_heads;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t s = item / cache.kv_heads, g = item % cache.kv_heads;
    if (path == Path::kAvx512 && detail::attend_avx512(problem, s, g)) continue;
    if (path == Path::kAvx2 && detail::attend_avx2(problem, s, g)) continue;
    attend_portable(problem, s, g);
  }
}

}  // namespace sssd::kernels
