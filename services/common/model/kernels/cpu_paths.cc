#include "cpu_paths.h"

#include <atomic>
#include <stdexcept>

namespace sssd::kernels {
namespace {

constexpr const char* kKernelNames[kNumKernels] = {"tree_attention", "attention_scores",
                                                   "panels", "argmax"};
constexpr const char* kPathNames[] = {"none", "portable", "avx2", "avx512", "dpbf16", "amx"};
constexpr int32_t kNotForced = -1;

std::atomic<int32_t> forced[kNumKernels] = {kNotForced, kNotForced, kNotForced, kNotForced};

CpuFeatures read_features() {
  CpuFeatures features;
#if defined(__x86_64__) && defined(__GNUC__)
  features.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  features.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  features.avx512_bf16 = features.avx512 && __builtin_cpu_supports("avx512bf16");
  features.amx_bf16 = has_amx_bf16();
#endif
  return features;
}

// The CPU's best path for (kernel, dtype).
Path best(Kernel kernel, Dtype dtype) {
  const CpuFeatures& cpu = cpu_features();
  const bool bf16 = dtype == Dtype::kBFloat16;
  switch (kernel) {
    case Kernel::kTreeAttention:
      return cpu.avx512 ? Path::kAvx512 : cpu.avx2_fma ? Path::kAvx2 : Path::kPortable;
    case Kernel::kAttentionScores:
      if (!cpu.avx512) return Path::kNone;
      if (bf16 && cpu.amx_bf16) return Path::kAmx;
      if (bf16 && cpu.avx512_bf16) return Path::kDpbf16;
      return Path::kAvx512;
    case Kernel::kPanels:
      if (bf16 ? cpu.avx512_bf16 : cpu.avx512) return Path::kAvx512;
      return cpu.avx2_fma ? Path::kAvx2 : Path::kNone;
    case Kernel::kArgmax:
      return cpu.avx512 ? Path::kAvx512 : Path::kPortable;
  }
  return Path::kNone;
}

// Whether `kernel` can run `path` for `dtype` on this CPU.
bool runs(Kernel kernel, Path path, Dtype dtype) {
  const CpuFeatures& cpu = cpu_features();
  const bool bf16 = dtype == Dtype::kBFloat16;
  switch (kernel) {
    case Kernel::kTreeAttention:
      return path == Path::kPortable || (path == Path::kAvx2 && cpu.avx2_fma) ||
             (path == Path::kAvx512 && cpu.avx512);
    case Kernel::kAttentionScores:  // the float32 scores are always the vector loop's
      return (path == Path::kAvx512 && cpu.avx512) ||
             (path == Path::kDpbf16 && cpu.avx512_bf16) || (path == Path::kAmx && cpu.amx_bf16);
    case Kernel::kPanels:
      return path == Path::kNone || (path == Path::kAvx2 && cpu.avx2_fma) ||
             (path == Path::kAvx512 && (bf16 ? cpu.avx512_bf16 : cpu.avx512));
    case Kernel::kArgmax:
      return path == Path::kPortable || (path == Path::kAvx512 && cpu.avx512);
  }
  return false;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = read_features();
  return features;
}

Path path_of(Kernel kernel, Dtype dtype) {
  const int32_t force = forced[static_cast<int32_t>(kernel)].load(std::memory_order_relaxed);
  if (kernel == Kernel::kAttentionScores && dtype == Dtype::kFloat32) {
    return best(kernel, dtype);  // only bfloat16 has a choice of scores
  }
  return force == kNotForced ? best(kernel, dtype) : static_cast<Path>(force);
}

std::string force_path(const std::string& kernel_text, const std::string& path_text) {
  int32_t kernel = 0;
  while (kernel < kNumKernels && kernel_text != kKernelNames[kernel]) ++kernel;
  if (kernel == kNumKernels) throw std::invalid_argument("unknown kernel " + kernel_text);
  int32_t path = kNotForced;
  if (!path_text.empty()) {
    path = 0;
    while (path < 6 && path_text != kPathNames[path]) ++path;
    const Kernel which = static_cast<Kernel>(kernel);
    // Scores are chosen for bfloat16 only; every other kernel must run the path in both dtypes.
    const bool can = path < 6 && runs(which, static_cast<Path>(path), Dtype::kBFloat16) &&
                     (which == Kernel::kAttentionScores ||
                      runs(which, static_cast<Path>(path), Dtype::kFloat32));
    if (!can) {
      throw std::invalid_argument(kernel_text + " cannot run path '" + path_text +
                                  "' on this CPU");
    }
  }
  const int32_t previous = forced[kernel].exchange(path);
  return previous == kNotForced ? "" : kPathNames[previous];
}

const char* kernel_name(Kernel kernel) { return kKernelNames[static_cast<int32_t>(kernel)]; }

const char* path_name(Path path) { return kPathNames[static_cast<int32_t>(path)]; }

}  // namespace sssd::kernels
