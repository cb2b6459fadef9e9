// Merging candidate trees from several sources into one draft tree (the SSSD paper, arXiv 2411.05894, Algorithm 3).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "count_tree.h"
#include "draft_tree.h"
#include "input_trie.h"
#include "params.h"

namespace sssd {

// One source tree for the merge: the subtree of `tree` rooted at `root`, with its discounts.
struct MergeSource {
  const CountTree* tree;
  int32_t root;
  double discount;        // factor on first-level priorities
  double child_discount;  // factor per level below the first
  // Input-trie sources: a node's probability of going on to a child is count(child) over the
  // children's total, not over the node's own count, which also counts the occurrence that
  // ends the sequence (its own current suffix, which has no continuation yet).
  bool over_children = false;
};

// Scratch memory that a worker thread reuses across calls.
struct MergeScratch {
  struct Entry {
    double priority;
    int32_t depth;
    int64_t sequence;  // push order, the last tie-breaker
    int32_t source;
    int32_t node;
    int32_t parent;    // draft-tree node the token goes under
  };
  std::vector<Entry> heap;
  std::vector<int32_t> children;  // sorted children of the node being expanded
};

// Algorithm 3 with the tie-breaking of docs/algorithm.md. `dec_len` counts the root.
void merge_sources(std::span<const MergeSource> sources, int32_t root_token, int32_t dec_len,
                   MergeScratch& scratch, DraftTree& out);

// The sources of one sequence in docs/algorithm.md order: the datastore tree (if it has children),
// then the input matches, longest first, then the copy chain (if it has a token).
std::vector<MergeSource> make_sources(const CountTree* datastore_tree, const InputTrie& trie,
                                      const std::vector<InputMatch>& matches,
                                      const CountTree* copy_chain, const DrafterParams& params);

// The copy source's chain (docs/algorithm.md, Copy source) as a tree of one path, counts 1: the
// tokens that followed `match` in the trie's sequence, at most params.copy_len. Empty (the root
// alone) without a match.
void build_copy_chain(const InputTrie& trie, const CopyMatch& match, const DrafterParams& params,
                      CountTree& out);

}  // namespace sssd
