// Per-sequence trie over prompt + self-output (the SSSD paper, arXiv 2411.05894, Appendix A.1, Algorithm 1).
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "count_tree.h"

namespace sssd {

// A match of a suffix of the prefix in the trie: the node where the walk ended and its length m.
struct InputMatch {
  int32_t node;
  int32_t match_len;
};

// The latest earlier occurrence of the sequence's longest suffix found (the copy source):
// tokens()[end - match_len, end) equal the last match_len tokens, end < the sequence's length.
struct CopyMatch {
  int32_t end = -1;  // -1: none
  int32_t match_len = 0;
};

class InputTrie {
 public:
  explicit InputTrie(int32_t branch_len);

  // Inserts the windows that `tokens` completes or starts; equal to a rebuild over the whole
  // sequence (every window of branch_len tokens, shorter ones at the end).
  void append(std::span<const int32_t> tokens);

  // Algorithm 1: every suffix of the last `prefix_len` tokens found in the trie, longest first.
  std::vector<InputMatch> match(int32_t prefix_len) const;

  // The copy source's match (docs/algorithm.md, Copy source): for m from min(branch_len,
  // length - 1) down to min_len, the suffix of m tokens, at the latest end before the sequence's
  // own; none if no such m. min_len >= 1.
  CopyMatch copy_match(int32_t min_len) const;

  const CountTree& tree() const { return tree_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int32_t branch_len() const { return branch_len_; }

  // A batch call locks each sequence it touches so that concurrent calls naming the same
  // sequence (a caller bug, but possible over the wire) serialize instead of racing.
  std::mutex& mutex() { return mutex_; }

 private:
  int32_t branch_len_;
  CountTree tree_;
  std::vector<int32_t> tokens_;                          // the whole sequence
  // Windows still growing: (node where the window ends, its length), oldest first.
  std::vector<std::pair<int32_t, int32_t>> open_windows_;
  // Per node: the end (one past the last token) of the n-gram's latest occurrence, and of the one
  // before it, -1 if none. The latest is the sequence's own suffix when the n-gram ends it, so
  // the one before is the earlier occurrence the copy source continues from.
  std::vector<int32_t> last_end_;
  std::vector<int32_t> previous_end_;
  std::mutex mutex_;
};

}  // namespace sssd
