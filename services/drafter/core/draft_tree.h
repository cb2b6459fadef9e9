// The one draft-tree shape of the project: token_ids + parents (+ probs), parents before children.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sssd {

struct DraftTree {
  std::vector<int32_t> token_ids;  // [num_nodes]; node 0 is the root (last accepted token)
  std::vector<int32_t> parents;    // [num_nodes]; -1 for the root, else an index < own index
  std::vector<float> probs;        // [num_nodes]; merge priority, 1.0 for the root

  int32_t size() const { return static_cast<int32_t>(token_ids.size()); }
};

// Invariant checker: returns "" when `tree` is a well-formed draft tree of at most `max_nodes`
// nodes whose root token is `root_token`, else a description of the first violation.
std::string check_draft_tree(const DraftTree& tree, int32_t max_nodes, int32_t root_token);

}  // namespace sssd
