// Tunable constants of the SSSD drafter ("SSSD: Simply-Scalable Speculative Decoding",
// arXiv 2411.05894, Appendix A). The defaults are defined here only: the Python configuration
// (sssd.drafter.config.DraftParams) reads them from the core. They are the paper's except
// branch_len and datastore_child_discount, tuned on held-out data, and the copy source's, which
// the paper does not have. docs/algorithm.md defines how each one is used.
#pragma once

#include <cstdint>

namespace sssd {

struct DrafterParams {
  int32_t prefix_len = 4;             // P: longest suffix of the sequence used as a lookup key
  int32_t branch_len = 16;            // tuned on held-out data (docs/algorithm.md)
  int32_t max_continuations = 100;    // datastore samples per prefix length, all shards together
  int32_t min_continuations = 50;     // shorten the datastore prefix while fewer were sampled
  double datastore_discount = 1.0;    // first-level factor, datastore source
  double input_discount = 0.6;        // first-level factor, input-trie sources
  double datastore_child_discount = 0.8;  // tuned on held-out data (docs/algorithm.md)
  double input_child_discount_base = 0.6;       // input child discount = base + per_match * m
  double input_child_discount_per_match = 0.1;
  // Not in the paper: the copy source (docs/algorithm.md, Copy source). When the last
  // copy_min_match or more tokens occurred before, the tokens that followed their latest earlier
  // occurrence are drafted as one chain, up to copy_len deep: an answer that copies a span of
  // its prompt (an edited file, a quoted document) follows it for far longer than the trie's
  // windows reach. copy_min_match = 0 turns it off.
  int32_t copy_min_match = 4;
  int32_t copy_len = 32;
  double copy_discount = 0.9;          // first-level factor of the chain
  double copy_child_discount = 0.95;   // factor per level below the first

  // Returns an empty string when every field is in range, else what is wrong.
  const char* validate() const;
};

}  // namespace sssd
