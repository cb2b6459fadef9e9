#include "count_tree.h"

#include <algorithm>

namespace sssd {
namespace {

inline uint64_t mix(uint64_t x) {  // splitmix64 finalizer: spreads (parent, token) keys
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

constexpr size_t kInitialSlots = 1024;

}  // namespace

void CountTree::reset(int32_t root_token) {
  nodes_.clear();
  nodes_.push_back(CountNode{root_token, 0, -1, -1, -1});
  if (slot_keys_.empty()) {
    slot_keys_.assign(kInitialSlots, 0);
    slot_nodes_.assign(kInitialSlots, -1);
    slot_stamps_.assign(kInitialSlots, 0);
  }
  if (++stamp_ == 0) {  // wrapped: clear stamps for real once every 2^32 resets
    std::fill(slot_stamps_.begin(), slot_stamps_.end(), 0);
    stamp_ = 1;
  }
}

size_t CountTree::slot_of(uint64_t k) const {
  const size_t mask = slot_keys_.size() - 1;
  size_t slot = mix(k) & mask;
  while (slot_stamps_[slot] == stamp_ && slot_keys_[slot] != k) slot = (slot + 1) & mask;
  return slot;
}

int32_t CountTree::find_child(int32_t parent, int32_t token) const {
  const size_t slot = slot_of(key(parent, token));
  return slot_stamps_[slot] == stamp_ ? slot_nodes_[slot] : -1;
}

void CountTree::grow() {
  const size_t capacity = slot_keys_.size() * 2;
  slot_keys_.assign(capacity, 0);
  slot_nodes_.assign(capacity, -1);
  slot_stamps_.assign(capacity, 0);
  stamp_ = 1;
  for (int32_t i = 1; i < size(); ++i) {
    const size_t slot = slot_of(key(nodes_[i].parent, nodes_[i].token));
    slot_keys_[slot] = key(nodes_[i].parent, nodes_[i].token);
    slot_nodes_[slot] = i;
    slot_stamps_[slot] = stamp_;
  }
}

int32_t CountTree::get_or_add_child(int32_t parent, int32_t token) {
  const uint64_t k = key(parent, token);
  size_t slot = slot_of(k);
  if (slot_stamps_[slot] == stamp_) return slot_nodes_[slot];
  const int32_t created = size();
  nodes_.push_back(CountNode{token, 0, parent, -1, nodes_[parent].first_child});
  nodes_[parent].first_child = created;
  // Keep the load factor at or below one half so probes stay short.
  if (static_cast<size_t>(size()) * 2 > slot_keys_.size()) {
    grow();
    return created;
  }
  slot_keys_[slot] = k;
  slot_nodes_[slot] = created;
  slot_stamps_[slot] = stamp_;
  return created;
}

void CountTree::insert_path(std::span<const int32_t> tokens, int32_t weight) {
  int32_t current = 0;
  nodes_[0].count += weight;
  for (int32_t token : tokens) {
    current = get_or_add_child(current, token);
    nodes_[current].count += weight;
  }
}

void CountTree::sorted_children(int32_t parent, std::vector<int32_t>& out) const {
  out.clear();
  for (int32_t c = nodes_[parent].first_child; c != -1; c = nodes_[c].next_sibling) {
    out.push_back(c);
  }
  std::sort(out.begin(), out.end(),
            [&](int32_t a, int32_t b) { return nodes_[a].token < nodes_[b].token; });
}

std::string CountTree::check() const {
  std::vector<int32_t> children;
  for (int32_t i = 0; i < size(); ++i) {
    int64_t child_total = 0;
    sorted_children(i, children);
    for (size_t j = 0; j < children.size(); ++j) {
      const int32_t c = children[j];
      if (c <= 0 || c >= size()) return "child index out of range at node " + std::to_string(i);
      if (nodes_[c].parent != i) return "child with a wrong parent link at node " + std::to_string(c);
      if (j > 0 && nodes_[children[j - 1]].token == nodes_[c].token) {
        return "two children with the same token under node " + std::to_string(i);
      }
      if (find_child(i, nodes_[c].token) != c) {
        return "hash index misses node " + std::to_string(c);
      }
      if (nodes_[c].count < 1) return "child with zero count under node " + std::to_string(i);
      child_total += nodes_[c].count;
    }
    // Every insertion that passes through a child also passed through its parent.
    if (child_total > nodes_[i].count) {
      return "children count more than their parent at node " + std::to_string(i);
    }
  }
  return "";
}

}  // namespace sssd
