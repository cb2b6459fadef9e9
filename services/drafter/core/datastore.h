// Suffix-array datastore and candidate retrieval ("SSSD: Simply-Scalable Speculative Decoding", arXiv 2411.05894, Appendix A.2, Algorithm 2).
// Shards are views over memory owned elsewhere (memory-mapped files); nothing is copied.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "count_tree.h"
#include "params.h"

namespace sssd {

// One sub-index: a token stream of whole documents, each followed by kDocumentSeparator, its
// suffix array, and the first-token index (where each first token's block of the suffix array
// starts).
struct ShardView {
  std::span<const uint32_t> stream;        // [num_tokens]
  std::span<const uint32_t> suffix_array;  // [num_tokens]
  // [vocab_size + 2]; bucket_starts[t] is the first suffix-array row whose suffix starts with
  // token t; row bucket_starts[vocab_size] starts the separator block and
  // bucket_starts[vocab_size + 1] == num_tokens.
  std::span<const uint32_t> bucket_starts;
  // Every continuation sampled from this shard counts `weight` times, and the shard's share of
  // max_continuations is computed from weight * its length (docs/algorithm.md, "Shard weights"):
  // 1 for an offline corpus, more for the served model's own text.
  int32_t weight = 1;
};

// Largest shard weight accepted; counts stay far below int32 overflow.
inline constexpr int32_t kMaxShardWeight = 1000;

// A half-open range of suffix-array rows.
struct SaRange {
  uint32_t begin;
  uint32_t end;
};

class Datastore {
 public:
  Datastore(std::vector<ShardView> shards, uint32_t vocab_size, int32_t max_continuations);

  // Algorithm 2: the weighted tree of continuations of the sequence's prefix (docs/algorithm.md).
  // `tree` is reset and reused so that callers can keep its memory across calls.
  void collect(std::span<const int32_t> sequence, const DrafterParams& params,
               CountTree& tree) const;

  // Rows of `shard` whose suffixes start with `query`.
  SaRange find(int32_t shard, std::span<const int32_t> query) const;

  int32_t num_shards() const { return static_cast<int32_t>(shards_.size()); }
  int64_t num_tokens() const { return num_tokens_; }
  uint32_t vocab_size() const { return vocab_size_; }
  const std::vector<int32_t>& quotas() const { return quotas_; }

  // Checks every structural invariant of `shard` (lengths, bucket index, suffix order when
  // `check_order`); "" if sound, else the first violation. O(n) with order checking.
  std::string check_shard(int32_t shard, bool check_order) const;

 private:
  std::vector<ShardView> shards_;
  uint32_t vocab_size_;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> quotas_;  // continuations per shard for max_continuations
};

// Largest-remainder split of `total` over shards in proportion to `sizes` (docs/algorithm.md).
std::vector<int32_t> apportion(int32_t total, const std::vector<int64_t>& sizes);

}  // namespace sssd
