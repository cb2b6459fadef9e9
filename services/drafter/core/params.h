// Tunable constants of the SSSD drafter ("SSSD: Simply-Scalable Speculative Decoding",
// arXiv 2411.05894, Appendix A). The defaults are defined here only: the Python configuration
// (sssd.drafter.config.DraftParams) reads them from the core. They are the paper's except
// branch_len and datastore_child_discount, tuned on held-out data. docs/algorithm.md defines
// how each one is used.
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

  // Returns an empty string when every field is in range, else what is wrong.
  const char* validate() const;
};

}  // namespace sssd
