// A tree of tokens with occurrence counts. Child lookup is a hash probe, so wide nodes (the
// root of a datastore tree, a frequent token in the input trie) cost O(1) per insertion.
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
  int32_t parent = -1;
  int32_t first_child = -1;   // children form a list in reverse insertion order; -1 if none
  int32_t next_sibling = -1;
};

class CountTree {
 public:
  // Node 0 is the root with token `root_token` and count 0.
  explicit CountTree(int32_t root_token = -1) { reset(root_token); }

  // Empties the tree but keeps its memory, so per-call trees allocate nothing when warm.
  void reset(int32_t root_token);

  // Returns the child of `parent` holding `token`, or -1.
  int32_t find_child(int32_t parent, int32_t token) const;

  // Returns the child of `parent` holding `token`, creating it (count 0) if absent.
  int32_t get_or_add_child(int32_t parent, int32_t token);

  // Adds `weight` to the root and to every node along `tokens` from the root.
  void insert_path(std::span<const int32_t> tokens, int32_t weight = 1);

  // Writes the children of `parent` into `out` in ascending token order (the merge's order).
  void sorted_children(int32_t parent, std::vector<int32_t>& out) const;

  const CountNode& node(int32_t index) const { return nodes_[index]; }
  CountNode& node(int32_t index) { return nodes_[index]; }
  int32_t size() const { return static_cast<int32_t>(nodes_.size()); }

  // "" if links, hash index and counts are consistent (children never count more than their
  // parent, siblings hold distinct tokens), else the first violation.
  std::string check() const;

 private:
  static uint64_t key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) |
           static_cast<uint32_t>(token);
  }
  size_t slot_of(uint64_t key) const;  // the slot holding key, or the empty slot where it goes
  void grow();

  std::vector<CountNode> nodes_;
  // Open addressing, linear probing. A slot is live when its stamp equals stamp_, so reset()
  // empties the table in O(1) by bumping stamp_.
  std::vector<uint64_t> slot_keys_;
  std::vector<int32_t> slot_nodes_;
  std::vector<uint32_t> slot_stamps_;
  uint32_t stamp_ = 1;
};

}  // namespace sssd
