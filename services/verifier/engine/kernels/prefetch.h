// How the AVX-512 panels stream their weights when a step has more rows than one pass takes
// (6): the rows go over a block of a panel in passes, the first reading it from memory, the
// others from the core's cache. Without help, memory idles during the later passes, and a step
// of 12 rows costs the first pass's reading plus the second pass's arithmetic. So the passes
// take turns asking for the next block (into L2), a whole step's lines at a time (asking line
// by line, two passes would split each 128-byte pair of lines that the L2 fetches together, and
// the first would fetch it all: slower than not asking), and the weights stream while every
// pass computes. Qwen2.5-Coder-1.5B's products on the AMX Xeon, ms on 8 / 12 / 20 rows,
// medians of 7 rounds taking turns in one process: float32 365 / 387 / 512 -> 326 / 358 / 448,
// bfloat16 (5 rounds) 240 / 290 / 437 -> 211 / 278 / 408; 1 and 4 rows (one pass) unchanged.
// The AMX products (16 rows a pass, and little arithmetic per pass) showed no gain from it.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sssd::kernels::detail {
// An unnamed namespace: each file compiled for its own instruction set keeps its own copy
// (panels_loop.h says why).
namespace {

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
