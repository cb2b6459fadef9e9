// The batched drafting call: for every sequence of a batch, append its new tokens to its input
// trie, query the datastore, merge, and emit a draft tree, in parallel over the batch.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "datastore.h"
#include "draft_tree.h"
#include "input_trie.h"
#include "params.h"
#include "thread_pool.h"

namespace sssd {

// Draft trees of a batch, flattened: row i owns nodes [cu_num_nodes[i], cu_num_nodes[i + 1]).
// Parents are indices local to the row's tree.
struct DraftBatch {
  std::vector<int32_t> token_ids;     // [total_nodes]
  std::vector<int32_t> parents;       // [total_nodes]
  std::vector<float> probs;           // [total_nodes]
  std::vector<int64_t> cu_num_nodes;  // [num_seqs + 1]
};

class BatchDrafter {
 public:
  // Throws std::invalid_argument if `params` is out of range or num_threads < 1.
  BatchDrafter(const DrafterParams& params, int32_t num_threads);

  // Row i appends new_tokens[cu_num_new_tokens[i], cu_num_new_tokens[i + 1]) to tries[i], then
  // drafts a tree of at most budgets[i] nodes. `datastore` may be null (input trie only).
  // Tries must be distinct; callers validate token ranges. Thread-safe.
  void propose(const Datastore* datastore, std::span<InputTrie* const> tries,
               std::span<const int32_t> new_tokens, std::span<const int64_t> cu_num_new_tokens,
               std::span<const int32_t> budgets, DraftBatch& out);

  // One sequence, no appending: the building block of `propose`, exposed for tests.
  void propose_one(const Datastore* datastore, const InputTrie& trie, int32_t budget,
                   DraftTree& out) const;

  const DrafterParams& params() const { return params_; }
  int32_t num_threads() const { return pool_->num_threads(); }

 private:
  DrafterParams params_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace sssd
