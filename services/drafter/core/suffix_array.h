// Suffix-array construction by induced sorting (SA-IS; Nong, Zhang and Chan, 2009), O(n) time.
#pragma once

#include <cstdint>
#include <span>

namespace sssd {

// Separator written after every document in a shard's token stream. It sorts above every token,
// so no query (which never contains it) matches across a document boundary.
inline constexpr uint32_t kDocumentSeparator = 0xFFFFFFFFu;

// Writes the suffix array of `stream` into `out_sa` (same length). Tokens must be < vocab_size;
// kDocumentSeparator is allowed anywhere. Suffixes are ordered as sequences of uint32, a proper
// prefix before its extensions. Throws std::invalid_argument on an out-of-range token.
void build_suffix_array(std::span<const uint32_t> stream, uint32_t vocab_size,
                        std::span<uint32_t> out_sa);

}  // namespace sssd
