#include "drafter.h"

#include <stdexcept>
#include <string>

#include "merge.h"

namespace sssd {
namespace {

// Per-thread memory reused across calls, so the hot path allocates little.
struct Scratch {
  CountTree datastore_tree;
  CountTree copy_chain;
  MergeScratch merge;
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

}  // namespace

BatchDrafter::BatchDrafter(const DrafterParams& params, int32_t num_threads) : params_(params) {
  const std::string problem = params.validate();
  if (!problem.empty()) throw std::invalid_argument(problem);
  if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
  pool_ = std::make_unique<ThreadPool>(num_threads);
}

void BatchDrafter::propose_one(const Datastore* datastore, const InputTrie& trie, int32_t budget,
                          DraftTree& out) const {
  const std::vector<int32_t>& sequence = trie.tokens();
  Scratch& scratch = thread_scratch();
  const CountTree* datastore_tree = nullptr;
  if (budget > 1 && datastore != nullptr && datastore->num_shards() > 0) {
    datastore->collect(sequence, params_, scratch.datastore_tree);
    datastore_tree = &scratch.datastore_tree;
  }
  std::vector<InputMatch> matches;
  const CountTree* copy_chain = nullptr;
  if (budget > 1) {
    matches = trie.match(params_.prefix_len);
    if (params_.copy_min_match > 0) {
      build_copy_chain(trie, trie.copy_match(params_.copy_min_match), params_, scratch.copy_chain);
      copy_chain = &scratch.copy_chain;
    }
  }
  const std::vector<MergeSource> sources =
      make_sources(datastore_tree, trie, matches, copy_chain, params_);
  merge_sources(sources, sequence.back(), budget, scratch.merge, out);
}

void BatchDrafter::propose(const Datastore* datastore, std::span<InputTrie* const> tries,
                      std::span<const int32_t> new_tokens,
                      std::span<const int64_t> cu_num_new_tokens,
                      std::span<const int32_t> budgets, DraftBatch& out) {
  const int32_t num_seqs = static_cast<int32_t>(tries.size());
  if (budgets.size() != tries.size() || cu_num_new_tokens.size() != tries.size() + 1) {
    throw std::invalid_argument("budgets and cu_num_new_tokens must match the number of rows");
  }
  if (cu_num_new_tokens[0] != 0 ||
      cu_num_new_tokens[num_seqs] != static_cast<int64_t>(new_tokens.size())) {
    throw std::invalid_argument("cu_num_new_tokens must start at 0 and end at len(new_tokens)");
  }
  for (int32_t i = 0; i < num_seqs; ++i) {
    if (cu_num_new_tokens[i + 1] < cu_num_new_tokens[i]) {
      throw std::invalid_argument("cu_num_new_tokens must be non-decreasing");
    }
    if (tries[i]->tokens().empty() && cu_num_new_tokens[i + 1] == cu_num_new_tokens[i]) {
      throw std::invalid_argument("row " + std::to_string(i) + " has no tokens to draft from");
    }
    if (budgets[i] < 1) throw std::invalid_argument("budgets must be >= 1");
  }

  std::vector<DraftTree> trees(num_seqs);
  pool_->parallel_for(num_seqs, [&](int32_t row, int32_t /*worker*/) {
    InputTrie& trie = *tries[row];
    std::lock_guard<std::mutex> lock(trie.mutex());
    trie.append(new_tokens.subspan(cu_num_new_tokens[row],
                                   cu_num_new_tokens[row + 1] - cu_num_new_tokens[row]));
    propose_one(datastore, trie, budgets[row], trees[row]);
  });

  out.cu_num_nodes.assign(1, 0);
  int64_t total = 0;
  for (const DraftTree& tree : trees) {
    total += tree.size();
    out.cu_num_nodes.push_back(total);
  }
  out.token_ids.clear();
  out.parents.clear();
  out.probs.clear();
  out.token_ids.reserve(total);
  out.parents.reserve(total);
  out.probs.reserve(total);
  for (const DraftTree& tree : trees) {
    out.token_ids.insert(out.token_ids.end(), tree.token_ids.begin(), tree.token_ids.end());
    out.parents.insert(out.parents.end(), tree.parents.begin(), tree.parents.end());
    out.probs.insert(out.probs.end(), tree.probs.begin(), tree.probs.end());
  }
}

}  // namespace sssd
