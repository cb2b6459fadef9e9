// The KV cache's commit in one call (kernels.h, move_positions).
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace sssd::kernels {

void move_positions(const KvLayout& cache, const std::vector<int64_t>& sources,
                    const std::vector<int64_t>& targets) {
  if (sources.size() != targets.size()) {
    throw std::invalid_argument("move_positions: one target per source");
  }
  const int64_t slots = cache.num_blocks * cache.block_size;
  for (size_t i = 0; i < sources.size(); ++i) {
    if (sources[i] < 0 || sources[i] >= slots || targets[i] < 0 || targets[i] >= slots) {
      throw std::out_of_range("move " + std::to_string(i) + " (" + std::to_string(sources[i]) +
                              " -> " + std::to_string(targets[i]) + ") lies outside the "
                              "cache's " + std::to_string(slots) + " positions");
    }
  }
  const size_t element = cache.dtype == Dtype::kFloat32 ? 4 : 2;
  const size_t bytes = static_cast<size_t>(cache.head_dim) * element;
  const size_t num_moves = sources.size();
  const int64_t heads = cache.kv_heads, size = cache.block_size;
  std::vector<char> gathered(num_moves * heads * bytes);
  // Position `slot` (block * block_size + offset) of head g.
  auto at = [&](char* base, int64_t slot, int64_t g) {
    return base + ((slot / size * heads + g) * size + slot % size) * bytes;
  };
  for (size_t layer = 0; layer < cache.keys.size(); ++layer) {
    for (const uintptr_t buffer : {cache.keys[layer], cache.values[layer]}) {
      char* base = reinterpret_cast<char*>(buffer);
      char* copy = gathered.data();
      for (size_t i = 0; i < num_moves; ++i) {
        for (int64_t g = 0; g < heads; ++g, copy += bytes) {
          std::memcpy(copy, at(base, sources[i], g), bytes);
        }
      }
      copy = gathered.data();
      for (size_t i = 0; i < num_moves; ++i) {
        for (int64_t g = 0; g < heads; ++g, copy += bytes) {
          std::memcpy(at(base, targets[i], g), copy, bytes);
        }
      }
    }
  }
}

}  // namespace sssd::kernels
