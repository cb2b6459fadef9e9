// Which implementation of each kernel this process runs: chosen once from the CPU's features,
// here and nowhere else. Every kernel asks `path_of` at each call; `force_path` overrides a
// choice for the tests and benchmarks that compare the paths, never beyond what the CPU has.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace sssd::kernels {

// What this CPU (and its OS, for AMX's tile state) offers, read once.
struct CpuFeatures {
  bool avx2_fma = false;     // AVX2 with FMA (AMD Zen 2 and later, Intel Haswell and later)
  bool avx512 = false;       // AVX-512 F, BW, VL, DQ
  bool avx512_bf16 = false;  // AVX-512 BF16's dot products (Zen 4, Cooper Lake, Sapphire Rapids)
  bool amx_bf16 = false;     // AMX tiles with bfloat16 products, granted by the OS
};
const CpuFeatures& cpu_features();

// The kernels whose implementation is chosen.
enum class Kernel : int32_t {
  kTreeAttention,    // attention(): portable, avx2, avx512
  kAttentionScores,  // the avx512 attention's scores in bfloat16: avx512, dpbf16, amx
  kPanels,           // linear_bf16 / linear_f32 / read_bytes: avx512, avx2, or none
  kArgmax,           // argmax_rows(): portable, avx512
};
inline constexpr int32_t kNumKernels = 4;

enum class Path : int32_t { kNone, kPortable, kAvx2, kAvx512, kDpbf16, kAmx };

// The path `kernel` runs for `dtype` now: the CPU's best unless forced.
Path path_of(Kernel kernel, Dtype dtype);

// Forces `kernel` (its name, e.g. "tree_attention") to `path` (e.g. "avx2") for every dtype, or
// with an empty `path` lets the CPU choose again; returns the previously forced path ("" for
// none). Throws std::invalid_argument for an unknown name, or a path the kernel has not or this
// CPU cannot run.
std::string force_path(const std::string& kernel, const std::string& path);

const char* kernel_name(Kernel kernel);
const char* path_name(Path path);

}  // namespace sssd::kernels
