#include "draft_tree.h"

#include "params.h"

namespace sssd {

std::string check_draft_tree(const DraftTree& tree, int32_t max_nodes, int32_t root_token) {
  const int32_t n = tree.size();
  if (tree.parents.size() != tree.token_ids.size() || tree.probs.size() != tree.token_ids.size()) {
    return "token_ids, parents and probs differ in length";
  }
  if (n < 1) return "the tree has no root";
  if (n > max_nodes) return "the tree has " + std::to_string(n) + " nodes, more than " +
                            std::to_string(max_nodes);
  if (tree.parents[0] != -1) return "node 0 is not the root";
  if (tree.token_ids[0] != root_token) return "the root token is not the last accepted token";
  for (int32_t i = 1; i < n; ++i) {
    const int32_t parent = tree.parents[i];
    if (parent < 0 || parent >= i) {
      return "node " + std::to_string(i) + " has parent " + std::to_string(parent) +
             ", not an earlier node";
    }
    if (!(tree.probs[i] > 0.0f) || tree.probs[i] > tree.probs[parent] * (1.0f + 1e-6f)) {
      return "node " + std::to_string(i) + " has a probability outside (0, parent's]";
    }
    for (int32_t j = parent + 1; j < i; ++j) {
      if (tree.parents[j] == parent && tree.token_ids[j] == tree.token_ids[i]) {
        return "nodes " + std::to_string(j) + " and " + std::to_string(i) +
               " are siblings with the same token";
      }
    }
  }
  return "";
}

const char* DrafterParams::validate() const {
  if (prefix_len < 1 || prefix_len > 64) return "prefix_len must be in [1, 64]";
  if (branch_len < 1 || branch_len > 64) return "branch_len must be in [1, 64]";
  if (prefix_len > branch_len) return "prefix_len must not exceed branch_len";
  if (max_continuations < 0) return "max_continuations must be >= 0";
  if (min_continuations < 0) return "min_continuations must be >= 0";
  // A zero factor would put zero-probability nodes in the tree: every factor that multiplies a
  // priority must be positive.
  for (double v : {datastore_discount, input_discount, datastore_child_discount,
                   input_child_discount_base}) {
    if (!(v > 0.0 && v <= 1.0)) return "discounts must be in (0, 1]";
  }
  if (!(input_child_discount_per_match >= 0.0 && input_child_discount_per_match <= 1.0)) {
    return "input_child_discount_per_match must be in [0, 1]";
  }
  if (input_child_discount_base + input_child_discount_per_match * prefix_len > 1.0 + 1e-12) {
    return "input_child_discount_base + input_child_discount_per_match * prefix_len must be <= 1";
  }
  // Keys are the trie's n-grams, at most branch_len tokens: a larger copy_min_match finds none
  // (a branch_len set below the default must not make the defaults invalid).
  if (copy_min_match < 0 || copy_min_match > 64) return "copy_min_match must be in [0, 64] (0: off)";
  if (copy_len < 1 || copy_len > 256) return "copy_len must be in [1, 256]";
  for (double v : {copy_discount, copy_child_discount}) {
    if (!(v > 0.0 && v <= 1.0)) return "copy discounts must be in (0, 1]";
  }
  return "";
}

}  // namespace sssd
