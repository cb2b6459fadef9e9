// The KV cache as the kernels read and write it, and the rows of a step: the types the kernel
// entry points take (bindings.cc binds them as sssd._kernels.KvLayout and StepRows).
//
// The cache is paged: each layer's keys and values are [num_blocks][kv_heads][block_size]
// [head_dim] arrays of the model's dtype, and row s of a step owns the blocks of its block
// table, in position order: position p of row s is at offset p % block_size of block
// block_tables[s][p / block_size]. block_size is a multiple of 16, so every run of 16 positions
// that starts at a multiple of 16 lies in one block (the attention kernels read keys 16 at a
// time). A cache of one block per sequence, as long as the sequence may grow (the speculator's
// slot cache), is the same layout with one-entry tables.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>


namespace sssd::kernels {

// The model's dtype: every tensor a kernel reads or writes is float32 or bfloat16.
enum class Dtype : int32_t { kFloat32 = 0, kBFloat16 = 1 };

// One cache: every layer's buffers and their shape. Made once per cache; the buffers never
// move (the cache keeps them).
struct KvLayout {
  std::vector<uintptr_t> keys, values;  // [num_layers] data pointers
  int64_t num_blocks = 0, block_size = 0, kv_heads = 0, head_dim = 0;
  Dtype dtype = Dtype::kFloat32;

  int64_t num_layers() const { return static_cast<int64_t>(keys.size()); }
  // Elements of one position of one head; of a whole block.
  int64_t block_elements() const { return kv_heads * block_size * head_dim; }
};

// The rows of one step (a segment of a forward pass): num_nodes tokens each, written at cache
// positions cache_lens[s] + j.
struct StepRows {
  int64_t num_seqs = 0, num_nodes = 0;
  const int64_t* cache_lens = nullptr;    // [num_seqs] tokens already cached per row
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks]
  int64_t max_blocks = 0;
  // [num_seqs, num_nodes]: bit a of node j set when node j sees node a (itself and its
  // ancestors); null where no attention reads it (rope_and_store, trees of more nodes than
  // attention() takes).
  const uint64_t* tree_bits = nullptr;
  const int64_t* position_ids = nullptr;  // [num_seqs * num_nodes] each token's rotary position
};

// Throw std::invalid_argument unless the layout is well formed / unless every position of every
// row (its cached ones and the step's nodes) lies in a block of the cache: the kernels then read
// and write within the buffers.
void check_layout(const KvLayout& cache);
void check_rows(const KvLayout& cache, const StepRows& rows);

namespace detail {

// One layer's attention of one step, as every attention path reads it.
struct AttentionProblem {
  const void* q;  // [num_seqs, num_nodes, heads, head_dim]
  void* out;      // [num_seqs, num_nodes, heads * head_dim]
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int64_t* cache_lens;
  const uint64_t* tree_bits;
  int64_t max_blocks, block_size, num_seqs, num_nodes, heads, kv_heads, head_dim;
  float scale;
  Dtype dtype;
  // Scores on the AMX tile unit / with AVX-512 BF16's dot products (bfloat16, the avx512
  // attention; cpu_paths.h decides).
  bool amx = false;
  bool dpbf16 = false;

  int64_t group() const { return heads / kv_heads; }
  // Offset (in elements) of position p of row s, key head g, in either cache.
  int64_t offset(int64_t s, int64_t g, int64_t p) const {
    const int64_t block = block_tables[s * max_blocks + p / block_size];
    return ((block * kv_heads + g) * block_size + p % block_size) * head_dim;
  }
  // Whether node j of row s sees the key at cache position p (< cache_lens[s] + num_nodes).
  bool visible(int64_t s, int64_t j, int64_t p) const {
    const int64_t cached = cache_lens[s];
    return p < cached || ((tree_bits[s * num_nodes + j] >> (p - cached)) & 1u);
  }
};

// Positions [0, length) of one (row, key head) of the paged cache (kv_layout.h): the base of
// each of its blocks, so that a run of positions within a block is read as one array.
// A view of a range of the row's positions holds the blocks from the range's first one, whose
// offset in its block is `origin` (a multiple of 16): the view's position p is that block's
// position origin + p.
struct PagedHead {
  const void* const* keys;    // [num_blocks] block i's first position, this head
  const void* const* values;
  int64_t block_size, head_dim;
  int64_t origin = 0;

  template <typename T>
  const T* key(int64_t p) const {
    p += origin;
    return static_cast<const T*>(keys[p / block_size]) + (p % block_size) * head_dim;
  }
  template <typename T>
  const T* value(int64_t p) const {
    p += origin;
    return static_cast<const T*>(values[p / block_size]) + (p % block_size) * head_dim;
  }
  // Positions from p to the end of p's block.
  int64_t run_from(int64_t p) const { return block_size - (p + origin) % block_size; }
};

// Row s, key head g's positions [first, end) (first a multiple of 16), their blocks' pointers
// kept in the two vectors.
inline PagedHead paged_head(const AttentionProblem& problem, int64_t s, int64_t g,
                            int64_t first, int64_t end, std::vector<const void*>& key_blocks,
                            std::vector<const void*>& value_blocks) {
  const int64_t size = problem.dtype == Dtype::kFloat32 ? 4 : 2;
  const int64_t bs = problem.block_size, start = first / bs;
  const int64_t blocks = std::max<int64_t>(0, (end + bs - 1) / bs - start);
  key_blocks.resize(std::max<int64_t>(1, blocks));
  value_blocks.resize(std::max<int64_t>(1, blocks));
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t offset = problem.offset(s, g, (start + i) * bs) * size;
    key_blocks[i] = static_cast<const char*>(problem.key_cache) + offset;
    value_blocks[i] = static_cast<const char*>(problem.value_cache) + offset;
  }
  return {key_blocks.data(), value_blocks.data(), bs, problem.head_dim, first % bs};
}

}  // namespace detail
}  // namespace sssd::kernels
