#include "kv_layout.h"

#include <stdexcept>
#include <string>

namespace sssd::kernels {

void check_layout(const KvLayout& cache) {
  if (cache.keys.size() != cache.values.size() || cache.keys.empty()) {
    throw std::invalid_argument("KvLayout: as many key buffers as value buffers, at least one");
  }
  if (cache.block_size < 16 || cache.block_size % 16 != 0) {
    throw std::invalid_argument("KvLayout: blocks of a multiple of 16 positions, got " +
                                std::to_string(cache.block_size));
  }
  if (cache.num_blocks < 1 || cache.kv_heads < 1 || cache.head_dim < 2 || cache.head_dim % 2) {
    throw std::invalid_argument("KvLayout: at least one block and one head, an even head size");
  }
}

void check_rows(const KvLayout& cache, const StepRows& rows) {
  if (rows.num_seqs < 0 || rows.num_nodes < 0 || rows.max_blocks < 1) {
    throw std::invalid_argument("StepRows: counts must be >= 0 and max_blocks >= 1");
  }
  for (int64_t s = 0; s < rows.num_seqs; ++s) {
    const int64_t length = rows.cache_lens[s] + rows.num_nodes;
    if (rows.cache_lens[s] < 0 || length > rows.max_blocks * cache.block_size) {
      throw std::invalid_argument("StepRows: row " + std::to_string(s) + "'s " +
                                  std::to_string(length) + " positions exceed its block table");
    }
    for (int64_t b = 0; b * cache.block_size < length; ++b) {
      const int32_t block = rows.block_tables[s * rows.max_blocks + b];
      if (block < 0 || block >= cache.num_blocks) {
        throw std::invalid_argument("StepRows: block " + std::to_string(block) + " of row " +
                                    std::to_string(s) + " outside the cache's " +
                                    std::to_string(cache.num_blocks));
      }
    }
  }
}

}  // namespace sssd::kernels
