#include "input_trie.h"

#include <algorithm>

namespace sssd {

InputTrie::InputTrie(int32_t branch_len) : branch_len_(branch_len), tree_(-1) {}

void InputTrie::append(std::span<const int32_t> tokens) {
  int32_t end = static_cast<int32_t>(tokens_.size());  // one past the token being added
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  for (int32_t token : tokens) {
    ++end;
    // A new window starts at this token; every open window grows by it.
    tree_.node(0).count += 1;
    open_windows_.emplace_back(0, 0);
    for (auto& [node, length] : open_windows_) {
      node = tree_.get_or_add_child(node, token);
      tree_.node(node).count += 1;
      length += 1;
      if (node >= static_cast<int32_t>(last_end_.size())) {
        last_end_.resize(tree_.size(), -1);
        previous_end_.resize(tree_.size(), -1);
      }
      // A node is reached once per end (by the window that starts `length` tokens before it).
      previous_end_[node] = last_end_[node];
      last_end_[node] = end;
    }
    // Windows are opened one per token, so only the oldest can reach branch_len.
    if (!open_windows_.empty() && open_windows_.front().second >= branch_len_) {
      open_windows_.erase(open_windows_.begin());
    }
  }
}

std::vector<InputMatch> InputTrie::match(int32_t prefix_len) const {
  std::vector<InputMatch> matches;
  const int32_t length = std::min<int32_t>(prefix_len, static_cast<int32_t>(tokens_.size()));
  const int32_t* end = tokens_.data() + tokens_.size();
  for (int32_t m = length; m >= 1; --m) {
    int32_t node = 0;
    for (const int32_t* it = end - m; it != end && node != -1; ++it) node = tree_.find_child(node, *it);
    if (node != -1) matches.push_back(InputMatch{node, m});
  }
  return matches;
}

CopyMatch InputTrie::copy_match(int32_t min_len) const {
  const int32_t size = static_cast<int32_t>(tokens_.size());
  const int32_t* end = tokens_.data() + size;
  for (int32_t m = std::min(branch_len_, size - 1); m >= std::max(min_len, 1); --m) {
    int32_t node = 0;
    for (const int32_t* it = end - m; it != end && node != -1; ++it) node = tree_.find_child(node, *it);
    // Every suffix of at most branch_len tokens is in the trie: its own window reaches it.
    if (node != -1 && previous_end_[node] != -1) return CopyMatch{previous_end_[node], m};
  }
  return CopyMatch{};
}

}  // namespace sssd
