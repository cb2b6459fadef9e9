#include "merge.h"

#include <algorithm>

namespace sssd {
namespace {

// Max-heap order: higher priority first, then the deeper node, then the earlier push.
struct EntryLess {
  bool operator()(const MergeScratch::Entry& a, const MergeScratch::Entry& b) const {
    if (a.priority != b.priority) return a.priority < b.priority;
    if (a.depth != b.depth) return a.depth < b.depth;
    return a.sequence > b.sequence;
  }
};

// The count that a node's children's probabilities divide by (docs/algorithm.md, Merge).
double denominator(const MergeSource& source, int32_t node, const std::vector<int32_t>& children) {
  if (!source.over_children) return static_cast<double>(source.tree->node(node).count);
  int64_t total = 0;
  for (int32_t c : children) total += source.tree->node(c).count;
  return static_cast<double>(total);
}

// Returns the child of draft node `parent` with `token`, appending it if absent.
int32_t insert_token(DraftTree& tree, int32_t parent, int32_t token, double priority) {
  for (int32_t i = parent + 1; i < tree.size(); ++i) {
    if (tree.parents[i] == parent && tree.token_ids[i] == token) return i;
  }
  tree.token_ids.push_back(token);
  tree.parents.push_back(parent);
  tree.probs.push_back(static_cast<float>(priority));
  return tree.size() - 1;
}

}  // namespace

std::vector<MergeSource> make_sources(const CountTree* datastore_tree, const InputTrie& trie,
                                      const std::vector<InputMatch>& matches,
                                      const CountTree* copy_chain, const DrafterParams& params) {
  std::vector<MergeSource> sources;
  sources.reserve(matches.size() + 2);
  if (datastore_tree != nullptr && datastore_tree->node(0).first_child != -1) {
    sources.push_back(MergeSource{datastore_tree, 0, params.datastore_discount,
                                  params.datastore_child_discount});
  }
  for (const InputMatch& match : matches) {
    sources.push_back(MergeSource{
        &trie.tree(), match.node, params.input_discount,
        params.input_child_discount_base + params.input_child_discount_per_match * match.match_len,
        /*over_children=*/true});
  }
  if (copy_chain != nullptr && copy_chain->node(0).first_child != -1) {
    sources.push_back(MergeSource{copy_chain, 0, params.copy_discount, params.copy_child_discount,
                                  /*over_children=*/true});
  }
  return sources;
}

void build_copy_chain(const InputTrie& trie, const CopyMatch& match, const DrafterParams& params,
                      CountTree& out) {
  out.reset(-1);
  if (match.end < 0) return;
  const std::vector<int32_t>& tokens = trie.tokens();
  const size_t stop = std::min(tokens.size(), static_cast<size_t>(match.end) + params.copy_len);
  out.insert_path(std::span<const int32_t>(tokens.data() + match.end, stop - match.end));
}

void merge_sources(std::span<const MergeSource> sources, int32_t root_token, int32_t dec_len,
                   MergeScratch& scratch, DraftTree& out) {
  out.token_ids.assign(1, root_token);
  out.parents.assign(1, -1);
  out.probs.assign(1, 1.0f);
  if (dec_len <= 1) return;

  auto& heap = scratch.heap;
  heap.clear();
  int64_t sequence = 0;
  const EntryLess less;
  auto push = [&](MergeScratch::Entry entry) {
    entry.sequence = sequence++;
    heap.push_back(entry);
    std::push_heap(heap.begin(), heap.end(), less);
  };

  for (int32_t s = 0; s < static_cast<int32_t>(sources.size()); ++s) {
    const MergeSource& source = sources[s];
    source.tree->sorted_children(source.root, scratch.children);
    const double total = denominator(source, source.root, scratch.children);
    for (int32_t c : scratch.children) {
      const double priority =
          (static_cast<double>(source.tree->node(c).count) / total) * source.discount;
      push({priority, 1, 0, s, c, 0});
    }
  }

  while (!heap.empty() && out.size() < dec_len) {
    std::pop_heap(heap.begin(), heap.end(), less);
    const MergeScratch::Entry entry = heap.back();
    heap.pop_back();
    const MergeSource& source = sources[entry.source];
    const CountNode& node = source.tree->node(entry.node);
    const int32_t draft_node = insert_token(out, entry.parent, node.token, entry.priority);
    source.tree->sorted_children(entry.node, scratch.children);
    const double total = denominator(source, entry.node, scratch.children);
    for (int32_t c : scratch.children) {
      const double priority =
          (static_cast<double>(source.tree->node(c).count) / total) * entry.priority *
          source.child_discount;
      push({priority, entry.depth + 1, 0, entry.source, c, draft_node});
    }
  }
}

}  // namespace sssd
