// How the panels (AVX-512 and AVX2) stream their weights: the first pass over a block asks for
// the panel's lines ahead (prefetch_stream). When a step has more rows than one pass takes
// (6): the rows go over a block of a panel in passes, the first reading it from memory, the
// others from the core's cache. Without help, memory idles during the later passes, and a step
// of 12 rows costs the first pass's reading plus the second pass's arithmetic. So the passes
// take turns asking for the next block (into L2), a whole step's lines at a time (asking line
// by line, two passes would split each 128-byte pair of lines that the L2 fetches together, and
// the first would fetch it all: slower than not asking), and the weights stream while every
// pass computes (bench/results/2026-11-27: faster from 8 rows on, unchanged at 1 and 4). The AMX
// products (16 rows a pass, and little arithmetic per pass) showed no gain from it.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sssd::kernels::detail {
// An unnamed namespace: each file compiled for its own instruction set keeps its own copy
// (panels_loop.h says why).
namespace {

// How far ahead of a step the first pass over a block asks for the panel's lines: into the
// core's second cache from far ahead, into its first from near ahead.
constexpr int64_t kStreamAhead = 4096;
constexpr int64_t kNearAhead = 1024;

// Asks for the panel's four lines kStreamAhead past `step` into L2 and those kNearAhead past it
// into L1. With a few rows each step costs more arithmetic than one, and the hardware
// prefetcher alone fell behind (bench/results/2026-11-26). Asking into L1 alone keeps no more
// lines in flight than the core's L1 fill buffers; asking into L2 from farther ahead keeps
// memory busier (bench/results/2026-11-27), with blocks of 64 steps, not 512-1024, so that a
// block stays in L1 for the later passes.
inline void prefetch_stream(const void* step) {
  const char* at = static_cast<const char*>(step);
  for (int line = 0; line < 4; ++line) _mm_prefetch(at + kStreamAhead + 64 * line, _MM_HINT_T1);
  for (int line = 0; line < 4; ++line) _mm_prefetch(at + kNearAhead + 64 * line, _MM_HINT_T0);
}


class NextBlock {
 public:
  // next: where the next block starts (past a panel's last block, the next panel's first);
  // step_bytes: what one step of a pass reads (a multiple of 64); pass of passes: this pass.
  NextBlock(const void* next, int64_t step_bytes, int64_t pass, int64_t passes)
      : cursor_(static_cast<const char*>(next)), step_bytes_(step_bytes), passes_(passes),
        countdown_(pass) {}

  // Called once per step of the pass, in order: on every passes-th step (this pass's turns),
  // asks for the next block's lines of that step.
  void step() {
    if (passes_ > 1) {
      if (countdown_ == 0) {
        for (int64_t at = 0; at < step_bytes_; at += 64) _mm_prefetch(cursor_ + at, _MM_HINT_T1);
        countdown_ = passes_;
      }
      --countdown_;
    }
    cursor_ += step_bytes_;
  }

 private:
  const char* cursor_;
  int64_t step_bytes_;
  int64_t passes_;
  int64_t countdown_;
};

}  // namespace
}  // namespace sssd::kernels::detail
