// A tree of tokens with occurrence counts, children kept in ascending token order.
// Used for the datastore candidate tree (rebuilt per call) and inside the input trie.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace sssd {

struct CountNode {
  int32_t token = -1;
  int32_t count = 0;
  int32_t first_child = -1;   // index of the child with the smallest token, -1 if none
  int32_t next_sibling = -1;  // next child of the same parent in ascending token order
};

class CountTree {
 public:
  // Node 0 is the root with token `root_token` and count 0.
  explicit CountTree(int32_t root_token = -1) { reset(root_token); }

  void reset(int32_t root_token);

  // Returns the child of `parent` holding `token`, or -1.
  int32_t find_child(int32_t parent, int32_t token) const;

  // Returns the child of `parent` holding `token`, creating it (count 0) in sorted position.
  int32_t get_or_add_child(int32_t parent, int32_t token);

  // Adds 1 to the root and to every node along `tokens` from the root.
  void insert_path(std::span<const int32_t> tokens);

  const CountNode& node(int32_t index) const { return nodes_[index]; }
  CountNode& node(int32_t index) { return nodes_[index]; }
  int32_t size() const { return static_cast<int32_t>(nodes_.size()); }

  // "" if counts and sibling order are consistent (a child never counts more than its parent,
  // siblings strictly ascending), else the first violation.
  std::string check() const;

 private:
  std::vector<CountNode> nodes_;
};

}  // namespace sssd
