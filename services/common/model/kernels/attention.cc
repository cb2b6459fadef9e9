// The attention entry point (kernels.h): the checks, the path cpu_paths.h chooses (the AVX-512
// or AVX2 tree attention, or the portable loop below), and the work split over the OpenMP
// threads.
//
// The AVX-512 and AVX2 paths cut a query's visible keys, in position order, into segments by
// rank: its k-th visible key is in segment k / kSegment, except that its last segment runs from
// its start to the query's end, more than kMaxTreeNodes keys long (segments_before). A rank is a
// function of what the query sees, so a node of a tree and the same token decoded alone (its
// ancestors then cached) cut the same keys the same way: every boundary lies in the cached keys,
// where rank and position agree, at least kMaxTreeNodes keys before the query's end. Each
// segment gives a partial result (the path's passes over it), and a query's partials are merged
// in segment order here, always the same sums whatever ran them. A query with a single segment
// (fewer than kSegment + kMaxTreeNodes keys) gets the bits the paths gave before they had
// segments. The segments are what the threads share when a step has fewer (row, key head) pairs
// than threads to keep busy, so a long context decoded alone spreads over every core; and a
// segment's scores stay in a core's cache however long the context.
#include <algorithm>
#include <climits>
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
using detail::kPartialHeader;
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

// Keys per segment (a multiple of 16, so a segment starts where a sixteen-key run does).
constexpr int64_t kSegment = 256;

// The segments before a query's last one, for a query that sees `visible` keys: its last
// segment keeps its last kMaxTreeNodes + 1 keys at least. Counting the one more makes the
// queries of a prompt's row of 64 from a multiple of 64 cut their keys alike (visible - 65 runs
// over [start - 64, start - 1], which no multiple of kSegment splits), so such a row needs no
// second kind of last segment.
int64_t segments_before(int64_t visible) {
  return std::max<int64_t>(0, visible - kMaxTreeNodes - 1) / kSegment;
}

int64_t keys_seen(const AttentionProblem& problem, int64_t s, int64_t j) {
  return problem.cache_lens[s] +
         __builtin_popcountll(problem.tree_bits[s * problem.num_nodes + j]);
}

// Row s's segments: those every query of the row has before its last (`shared`), and whether
// some queries have one more (`split`: their last segment is the others' last one cut in two at
// (shared + 1) * kSegment). A row's queries see from cached + 1 to cached + num_nodes keys,
// fewer than kSegment apart, so there are at most two kinds.
struct RowPlan {
  int64_t shared = 0;
  bool split = false;
};

RowPlan plan_of(const AttentionProblem& problem, int64_t s) {
  int64_t fewest = INT64_MAX, most = 0;
  for (int64_t j = 0; j < problem.num_nodes; ++j) {
    fewest = std::min(fewest, keys_seen(problem, s, j));
    most = std::max(most, keys_seen(problem, s, j));
  }
  const int64_t shared = segments_before(fewest);
  return {shared, segments_before(most) > shared};
}

using Segment = void (*)(const AttentionProblem&, int64_t, int64_t, int64_t, int64_t, float*);

// Query i of row s, key head g: its segments' partials merged in order (each weighs
// exp(its maximum - the largest)), the weighted values divided by the weighted sums, into the
// output in the model's dtype.
SSSD_CLONES void merge_and_store(const AttentionProblem& problem, int64_t s, int64_t g,
                                 int64_t i, const float* const* parts, int64_t num_parts) {
  const int64_t head_dim = problem.head_dim;
  const int64_t group = problem.group(), j = i / group, k = i % group;
  const int64_t offset = ((s * problem.num_nodes + j) * problem.heads + g * group + k) * head_dim;
  float result[128];  // head_dim 64 or 128 on the paths with segments
  if (num_parts == 1) {  // what the general case computes with a factor of exactly 1
    const float inverse = 1.0f / parts[0][1];
    for (int64_t d = 0; d < head_dim; ++d) result[d] = parts[0][kPartialHeader + d] * inverse;
    from_float(result, head_dim, problem.dtype, problem.out, offset);
    return;
  }
  float top = -INFINITY;
  for (int64_t n = 0; n < num_parts; ++n) top = std::max(top, parts[n][0]);
  float total = 0.0f;
  for (int64_t n = 0; n < num_parts; ++n) {
    const float factor = exp_nonpositive(parts[n][0] - top);
    total += factor * parts[n][1];
    const float* sums = parts[n] + kPartialHeader;
    for (int64_t d = 0; d < head_dim; ++d) {
      result[d] = n == 0 ? factor * sums[d] : result[d] + factor * sums[d];
    }
  }
  const float inverse = 1.0f / total;
  for (int64_t d = 0; d < head_dim; ++d) result[d] *= inverse;
  from_float(result, head_dim, problem.dtype, problem.out, offset);
}

// Row s, key head g after its shared segments (their partials given): the last segment (and the
// two that replace it for the queries with one more), then every query's merge.
void finish_row(const AttentionProblem& problem, Segment segment, int64_t s, int64_t g,
                const RowPlan& plan, const float* shared) {
  thread_local std::vector<float> tail;
  thread_local std::vector<const float*> parts;
  const int64_t width = kPartialHeader + problem.head_dim;
  const int64_t count = problem.group() * problem.num_nodes;
  const int64_t end = problem.cache_lens[s] + problem.num_nodes;
  const int64_t last = plan.shared * kSegment, cut = last + kSegment;
  tail.resize((plan.split ? 3 : 1) * count * width);
  float* whole = tail.data();
  float* before_cut = whole + count * width;
  float* after_cut = before_cut + count * width;
  segment(problem, s, g, last, end, whole);
  if (plan.split) {
    segment(problem, s, g, last, cut, before_cut);
    segment(problem, s, g, cut, end, after_cut);
  }
  parts.resize(plan.shared + 2);
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t n = 0; n < plan.shared; ++n) parts[n] = shared + (n * count + i) * width;
    int64_t num_parts = plan.shared;
    if (segments_before(keys_seen(problem, s, i / problem.group())) > plan.shared) {
      parts[num_parts++] = before_cut + i * width;
      parts[num_parts++] = after_cut + i * width;
    } else {
      parts[num_parts++] = whole + i * width;
    }
    merge_and_store(problem, s, g, i, parts.data(), num_parts);
  }
}

// The attention of a path with segments: whole (row, key head) pairs per thread while there are
// enough of them to share; else the shared segments are tasks of their own, their partials kept
// for the rows' finish.
void attend_in_segments(const AttentionProblem& problem, Segment segment) {
  const int64_t kv_heads = problem.kv_heads, items = problem.num_seqs * kv_heads;
  const int64_t width = kPartialHeader + problem.head_dim;
  const int64_t count = problem.group() * problem.num_nodes;
  std::vector<RowPlan> plans(problem.num_seqs);
  int64_t any_shared = 0;
  for (int64_t s = 0; s < problem.num_seqs; ++s) {
    plans[s] = plan_of(problem, s);
    any_shared += plans[s].shared;
  }
  if (items >= 2 * num_threads() || any_shared == 0) {
    thread_local std::vector<float> shared;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t s = item / kv_heads, g = item % kv_heads;
      shared.resize(std::max<int64_t>(1, plans[s].shared * count * width));
      for (int64_t n = 0; n < plans[s].shared; ++n) {
        segment(problem, s, g, n * kSegment, (n + 1) * kSegment,
                shared.data() + n * count * width);
      }
      finish_row(problem, segment, s, g, plans[s], shared.data());
    }
    return;
  }
  std::vector<int64_t> first_task(items + 1, 0);  // item's segments: tasks [first, next first)
  for (int64_t item = 0; item < items; ++item) {
    first_task[item + 1] = first_task[item] + plans[item / kv_heads].shared;
  }
  const int64_t tasks = first_task[items];
  std::vector<float> shared(tasks * count * width);
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t item =
          std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t s = item / kv_heads, g = item % kv_heads, n = task - first_task[item];
      segment(problem, s, g, n * kSegment, (n + 1) * kSegment,
              shared.data() + task * count * width);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      finish_row(problem, segment, item / kv_heads, item % kv_heads, plans[item / kv_heads],
                 shared.data() + first_task[item] * count * width);
    }
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
  const bool vector_head = cache.head_dim == 64 || cache.head_dim == 128;
  if (vector_head && path == Path::kAvx512) return attend_in_segments(problem,
                                                                      detail::segment_avx512);
  if (vector_head && path == Path::kAvx2) return attend_in_segments(problem,
                                                                    detail::segment_avx2);
  const int64_t items = rows.num_seqs * cache.kv_heads;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    attend_portable(problem, item / cache.kv_heads, item % cache.kv_heads);
  }
}

}  // namespace sssd::kernels
