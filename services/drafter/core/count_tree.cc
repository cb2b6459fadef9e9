#include "count_tree.h"

namespace sssd {

void CountTree::reset(int32_t root_token) {
  nodes_.clear();
  nodes_.push_back(CountNode{root_token, 0, -1, -1});
}

int32_t CountTree::find_child(int32_t parent, int32_t token) const {
  for (int32_t c = nodes_[parent].first_child; c != -1; c = nodes_[c].next_sibling) {
    if (nodes_[c].token == token) return c;
    if (nodes_[c].token > token) return -1;  // siblings are sorted
  }
  return -1;
}

int32_t CountTree::get_or_add_child(int32_t parent, int32_t token) {
  int32_t prev = -1;
  int32_t c = nodes_[parent].first_child;
  while (c != -1 && nodes_[c].token < token) {
    prev = c;
    c = nodes_[c].next_sibling;
  }
  if (c != -1 && nodes_[c].token == token) return c;
  const int32_t created = static_cast<int32_t>(nodes_.size());
  nodes_.push_back(CountNode{token, 0, -1, c});
  if (prev == -1) {
    nodes_[parent].first_child = created;
  } else {
    nodes_[prev].next_sibling = created;
  }
  return created;
}

void CountTree::insert_path(std::span<const int32_t> tokens) {
  int32_t current = 0;
  nodes_[0].count += 1;
  for (int32_t token : tokens) {
    current = get_or_add_child(current, token);
    nodes_[current].count += 1;
  }
}

std::string CountTree::check() const {
  for (int32_t i = 0; i < size(); ++i) {
    int64_t child_total = 0;
    int32_t last_token = -1;
    bool first = true;
    for (int32_t c = nodes_[i].first_child; c != -1; c = nodes_[c].next_sibling) {
      if (c <= 0 || c >= size()) return "child index out of range at node " + std::to_string(i);
      if (!first && nodes_[c].token <= last_token) {
        return "siblings not strictly ascending under node " + std::to_string(i);
      }
      if (nodes_[c].count < 1) return "child with zero count under node " + std::to_string(i);
      child_total += nodes_[c].count;
      last_token = nodes_[c].token;
      first = false;
    }
    // Every insertion that passes through a child also passed through its parent.
    if (child_total > nodes_[i].count) {
      return "children count more than their parent at node " + std::to_string(i);
    }
  }
  return "";
}

}  // namespace sssd
