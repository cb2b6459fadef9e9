#include "suffix_array.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace sssd {
namespace {

// SA-IS over an integer string whose last symbol is a unique smallest sentinel (0). Symbols are
// in [0, max_symbol]. `sa` has room for n entries. Types: true = S-type, false = L-type.
template <typename Symbol>
class InducedSorter {
 public:
  InducedSorter(const Symbol* text, int64_t n, int64_t max_symbol)
      : text_(text), n_(n), max_symbol_(max_symbol), is_s_(n), buckets_(max_symbol + 1) {}

  void run(int32_t* sa) {
    classify();
    // Stage 1: sort the LMS substrings.
    bucket_bounds(/*ends=*/true);
    std::fill(sa, sa + n_, -1);
    for (int64_t i = 1; i < n_; ++i) {
      if (is_lms(i)) sa[--buckets_[text_[i]]] = static_cast<int32_t>(i);
    }
    induce(sa);

    // Compact the sorted LMS positions into sa[0, num_lms).
    int64_t num_lms = 0;
    for (int64_t i = 0; i < n_; ++i) {
      if (is_lms(sa[i])) sa[num_lms++] = sa[i];
    }
    // Name the LMS substrings; equal substrings get equal names. LMS positions are at least two
    // apart, so pos / 2 is a collision-free slot in sa[num_lms, n).
    std::fill(sa + num_lms, sa + n_, -1);
    int32_t num_names = 0;
    int64_t previous = -1;
    for (int64_t i = 0; i < num_lms; ++i) {
      const int64_t position = sa[i];
      if (previous == -1 || !equal_lms_substrings(position, previous)) {
        ++num_names;
        previous = position;
      }
      sa[num_lms + position / 2] = num_names - 1;
    }
    for (int64_t i = n_ - 1, j = n_ - 1; i >= num_lms; --i) {
      if (sa[i] >= 0) sa[j--] = sa[i];
    }

    // Stage 2: sort the LMS suffixes, recursively if names repeat.
    int32_t* reduced = sa + n_ - num_lms;
    int32_t* reduced_sa = sa;
    if (num_names < num_lms) {
      InducedSorter<int32_t>(reduced, num_lms, num_names - 1).run(reduced_sa);
    } else {
      for (int64_t i = 0; i < num_lms; ++i) reduced_sa[reduced[i]] = static_cast<int32_t>(i);
    }

    // Stage 3: place the sorted LMS suffixes and induce the rest.
    for (int64_t i = 1, j = 0; i < n_; ++i) {
      if (is_lms(i)) reduced[j++] = static_cast<int32_t>(i);
    }
    for (int64_t i = 0; i < num_lms; ++i) reduced_sa[i] = reduced[reduced_sa[i]];
    std::fill(sa + num_lms, sa + n_, -1);
    bucket_bounds(/*ends=*/true);
    for (int64_t i = num_lms - 1; i >= 0; --i) {
      const int32_t position = sa[i];
      sa[i] = -1;
      sa[--buckets_[text_[position]]] = position;
    }
    induce(sa);
  }

 private:
  void classify() {
    is_s_[n_ - 1] = true;  // the sentinel
    if (n_ >= 2) is_s_[n_ - 2] = false;
    for (int64_t i = n_ - 3; i >= 0; --i) {
      is_s_[i] = text_[i] < text_[i + 1] || (text_[i] == text_[i + 1] && is_s_[i + 1]);
    }
  }

  bool is_lms(int64_t i) const { return i > 0 && is_s_[i] && !is_s_[i - 1]; }

  void bucket_bounds(bool ends) {
    std::fill(buckets_.begin(), buckets_.end(), 0);
    for (int64_t i = 0; i < n_; ++i) ++buckets_[text_[i]];
    int64_t sum = 0;
    for (int64_t c = 0; c <= max_symbol_; ++c) {
      sum += buckets_[c];
      buckets_[c] = ends ? sum : sum - buckets_[c];
    }
  }

  void induce(int32_t* sa) {
    bucket_bounds(/*ends=*/false);
    for (int64_t i = 0; i < n_; ++i) {
      const int64_t j = static_cast<int64_t>(sa[i]) - 1;
      if (j >= 0 && !is_s_[j]) sa[buckets_[text_[j]]++] = static_cast<int32_t>(j);
    }
    bucket_bounds(/*ends=*/true);
    for (int64_t i = n_ - 1; i >= 0; --i) {
      const int64_t j = static_cast<int64_t>(sa[i]) - 1;
      if (j >= 0 && is_s_[j]) sa[--buckets_[text_[j]]] = static_cast<int32_t>(j);
    }
  }

  bool equal_lms_substrings(int64_t a, int64_t b) const {
    for (int64_t d = 0;; ++d) {
      // The unique sentinel ends every comparison before either index runs past n.
      if (text_[a + d] != text_[b + d] || is_s_[a + d] != is_s_[b + d]) return false;
      if (d > 0 && (is_lms(a + d) || is_lms(b + d))) return true;
    }
  }

  const Symbol* text_;
  int64_t n_;
  int64_t max_symbol_;
  std::vector<bool> is_s_;
  std::vector<int64_t> buckets_;
};

}  // namespace

void build_suffix_array(std::span<const uint32_t> stream, uint32_t vocab_size,
                        std::span<uint32_t> out_sa) {
  const int64_t n = static_cast<int64_t>(stream.size());
  if (static_cast<int64_t>(out_sa.size()) != n) {
    throw std::invalid_argument("suffix array output has the wrong length");
  }
  if (n >= (int64_t{1} << 31) - 1) {
    throw std::invalid_argument("a shard holds at most 2^31 - 2 tokens");
  }
  if (n == 0) return;
  // Shift tokens by one and map the separator to vocab_size + 1 (keeping it the largest), then
  // append the sentinel 0.
  std::vector<int32_t> text(n + 1);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t token = stream[i];
    if (token == kDocumentSeparator) {
      text[i] = static_cast<int32_t>(vocab_size) + 1;
    } else if (token >= vocab_size) {
      throw std::invalid_argument("token " + std::to_string(token) + " at position " +
                                  std::to_string(i) + " is outside the vocabulary of size " +
                                  std::to_string(vocab_size));
    } else {
      text[i] = static_cast<int32_t>(token) + 1;
    }
  }
  text[n] = 0;
  std::vector<int32_t> sa(n + 1);
  InducedSorter<int32_t>(text.data(), n + 1, static_cast<int64_t>(vocab_size) + 1).run(sa.data());
  // sa[0] is the sentinel's own suffix.
  for (int64_t i = 0; i < n; ++i) out_sa[i] = static_cast<uint32_t>(sa[i + 1]);
}

}  // namespace sssd
