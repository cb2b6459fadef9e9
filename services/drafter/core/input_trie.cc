#include "input_trie.h"

#include <algorithm>

namespace sssd {

InputTrie::InputTrie(int32_t branch_len) : branch_len_(branch_len), tree_(-1) {}

void InputTrie::append(std::span<const int32_t> tokens) {
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  for (int32_t token : tokens) {
    // A new window starts at this token; every open window grows by it.
    tree_.node(0).count += 1;
    open_windows_.emplace_back(0, 0);
    for (auto& [node, length] : open_windows_) {
      node = tree_.get_or_add_child(node, token);
      tree_.node(node).count += 1;
      length += 1;
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

}  // namespace sssd
