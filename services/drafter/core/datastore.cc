#include "datastore.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "suffix_array.h"

namespace sssd {
namespace {

// Compares the suffix at `position` with `query` over the query's length: <0, 0 or >0. A suffix
// that ends first is smaller (a proper prefix sorts before its extensions).
inline int compare_suffix(std::span<const uint32_t> stream, uint32_t position,
                          std::span<const int32_t> query, size_t from) {
  const size_t n = stream.size();
  for (size_t i = from; i < query.size(); ++i) {
    const size_t at = position + i;
    if (at >= n) return -1;
    const uint32_t token = stream[at];
    const uint32_t wanted = static_cast<uint32_t>(query[i]);
    if (token != wanted) return token < wanted ? -1 : 1;
  }
  return 0;
}

}  // namespace

std::vector<int32_t> apportion(int32_t total, const std::vector<int64_t>& sizes) {
  std::vector<int32_t> quotas(sizes.size(), 0);
  const int64_t sum = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  if (sum <= 0 || total <= 0) return quotas;
  std::vector<int64_t> remainders(sizes.size());
  int64_t assigned = 0;
  for (size_t s = 0; s < sizes.size(); ++s) {
    quotas[s] = static_cast<int32_t>((total * sizes[s]) / sum);
    remainders[s] = (total * sizes[s]) % sum;
    assigned += quotas[s];
  }
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return remainders[a] > remainders[b]; });
  for (size_t k = 0; assigned < total; ++k, ++assigned) quotas[order[k]] += 1;
  return quotas;
}

Datastore::Datastore(std::vector<ShardView> shards, uint32_t vocab_size,
                     int32_t max_continuations)
    : shards_(std::move(shards)), vocab_size_(vocab_size) {
  std::vector<int64_t> sizes;
  for (const ShardView& shard : shards_) {
    if (shard.suffix_array.size() != shard.stream.size()) {
      throw std::invalid_argument("suffix array and token stream differ in length");
    }
    if (shard.bucket_starts.size() != static_cast<size_t>(vocab_size) + 2) {
      throw std::invalid_argument("bucket index must have vocab_size + 2 entries");
    }
    if (shard.weight < 1 || shard.weight > kMaxShardWeight) {
      throw std::invalid_argument("shard weight must be in [1, 1000]");
    }
    sizes.push_back(static_cast<int64_t>(shard.stream.size()) * shard.weight);
    num_tokens_ += static_cast<int64_t>(shard.stream.size());
  }
  quotas_ = apportion(max_continuations, sizes);
}

SaRange Datastore::find(int32_t shard_index, std::span<const int32_t> query) const {
  const ShardView& shard = shards_[shard_index];
  if (query.empty()) return SaRange{0, static_cast<uint32_t>(shard.stream.size())};
  // A token outside the vocabulary (a negative id cast to uint32 would equal the separator)
  // matches nothing, so a query can never reach across a document boundary.
  for (int32_t token : query) {
    if (static_cast<uint32_t>(token) >= vocab_size_) return SaRange{0, 0};
  }
  const uint32_t first = static_cast<uint32_t>(query[0]);
  // The first-token index narrows the search to one bucket; binary search the rest.
  uint32_t lo = shard.bucket_starts[first];
  uint32_t hi = shard.bucket_starts[first + 1];
  if (query.size() == 1 || lo == hi) return SaRange{lo, hi};
  // Lower bound: first row whose suffix is >= query.
  uint32_t left = lo, right = hi;
  while (left < right) {
    const uint32_t mid = left + (right - left) / 2;
    if (compare_suffix(shard.stream, shard.suffix_array[mid], query, 1) < 0) {
      left = mid + 1;
    } else {
      right = mid;
    }
  }
  const uint32_t begin = left;
  // Upper bound: first row whose suffix is > query (over the query's length).
  right = hi;
  while (left < right) {
    const uint32_t mid = left + (right - left) / 2;
    if (compare_suffix(shard.stream, shard.suffix_array[mid], query, 1) <= 0) {
      left = mid + 1;
    } else {
      right = mid;
    }
  }
  return SaRange{begin, left};
}

void Datastore::collect(std::span<const int32_t> sequence, const DrafterParams& params,
                        CountTree& tree) const {
  tree.reset(sequence.back());
  const int32_t prefix_len =
      std::min<int32_t>(params.prefix_len, static_cast<int32_t>(sequence.size()));
  thread_local std::vector<uint32_t> rows;  // sampled rows, then their stream positions
  int32_t path[64];
  const int32_t branch_len = std::min<int32_t>(params.branch_len, 64);
  for (int32_t length = prefix_len; length >= 1; --length) {
    if (tree.node(0).count >= params.min_continuations) break;  // continuations sampled
    const std::span<const int32_t> query = sequence.last(length);
    for (int32_t s = 0; s < num_shards(); ++s) {
      const int32_t quota = quotas_[s];
      if (quota == 0) continue;
      const SaRange range = find(s, query);
      const uint32_t count = range.end - range.begin;
      if (count == 0) continue;
      // Rows are sorted by continuation, so samples spread evenly over the whole range
      // approximate the continuation distribution: k * count / samples for k < samples (every
      // row when the range holds no more than the quota). A fixed stride floor(count / quota)
      // would cover only the start of a range holding between 1x and 2x the quota.
      const uint64_t samples = std::min<uint64_t>(count, static_cast<uint64_t>(quota));
      const ShardView& shard = shards_[s];
      const size_t n = shard.stream.size();
      // Every sampled row costs two cache misses (suffix array, then stream). Issue all of them
      // before using any, so they overlap instead of queueing one after another.
      rows.clear();
      for (uint64_t k = 0; k < samples; ++k) {
        const uint32_t row = range.begin + static_cast<uint32_t>(k * count / samples);
        rows.push_back(row);
        __builtin_prefetch(&shard.suffix_array[row]);
      }
      for (uint32_t& row : rows) {
        row = shard.suffix_array[row] + static_cast<uint32_t>(length);  // now a stream position
        __builtin_prefetch(&shard.stream[std::min<size_t>(row, n - 1)]);
      }
      for (const uint32_t start : rows) {
        int32_t path_len = 0;
        for (size_t at = start; at < n && path_len < branch_len; ++at) {
          const uint32_t token = shard.stream[at];
          if (token == kDocumentSeparator) break;
          path[path_len++] = static_cast<int32_t>(token);
        }
        tree.insert_path(std::span<const int32_t>(path, path_len), shard.weight);
      }
    }
  }
}

std::string Datastore::check_shard(int32_t shard_index, bool check_order) const {
  const ShardView& shard = shards_[shard_index];
  const size_t n = shard.stream.size();
  if (shard.suffix_array.size() != n) return "suffix array length differs from the stream";
  if (n > 0 && shard.stream[n - 1] != kDocumentSeparator) {
    return "the stream does not end with a document separator";
  }
  std::vector<uint32_t> counts(static_cast<size_t>(vocab_size_) + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t token = shard.stream[i];
    if (token == kDocumentSeparator) {
      counts[vocab_size_] += 1;
    } else if (token >= vocab_size_) {
      return "token " + std::to_string(token) + " at " + std::to_string(i) +
             " is outside the vocabulary";
    } else {
      counts[token] += 1;
    }
  }
  uint64_t start = 0;
  for (uint32_t t = 0; t <= vocab_size_; ++t) {
    if (shard.bucket_starts[t] != start) return "bucket index wrong at token " + std::to_string(t);
    start += counts[t];
  }
  if (shard.bucket_starts[vocab_size_ + 1] != n) return "bucket index does not end at n";
  if (!check_order) return "";
  std::vector<bool> seen(n, false);
  for (size_t row = 0; row < n; ++row) {
    const uint32_t position = shard.suffix_array[row];
    if (position >= n || seen[position]) return "suffix array is not a permutation";
    seen[position] = true;
    if (row == 0) continue;
    // Adjacent rows must be in strictly increasing suffix order.
    const uint32_t a = shard.suffix_array[row - 1];
    size_t d = 0;
    while (a + d < n && position + d < n && shard.stream[a + d] == shard.stream[position + d]) ++d;
    const bool a_smaller = (a + d == n) || (position + d < n &&
                                           shard.stream[a + d] < shard.stream[position + d]);
    if (!a_smaller) return "suffixes out of order at row " + std::to_string(row);
  }
  return "";
}

}  // namespace sssd
