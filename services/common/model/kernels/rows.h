// Row helpers of the portable kernels (layer_ops.cc, attention.cc, argmax.cc): float32 copies
// of rows of the model's dtype and back, and the dot product and scaled add that vectorize.
// Each hot loop is compiled three times, for AVX-512, AVX2 and any x86-64, and the copy this CPU
// runs is chosen at load time (a machine runs one of them throughout). The AVX2 copy rounds as
// the portable one (its target has no FMA to contract a multiply and an add into); the AVX-512
// one may contract them. In an unnamed namespace: each file keeps its own copies.
#pragma once

#include <cstdint>
#include <cstring>

#include "numbers.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define SSSD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SSSD_CLONES
#endif


namespace sssd::kernels::detail {
namespace {

// Rows run on the calling thread while they hold fewer values than this in all: a parallel
// region (a few microseconds) then costs more than their work saves. A step of 16 nodes of a
// 1.5B model (rows of 1,536 and 8,960 values) is split between the threads; a single row is
// never split, so a row's values never depend on the rows beside it.
constexpr int64_t kParallelValues = 16384;

[[maybe_unused]] bool worth_threads(int64_t rows, int64_t width) {
  return rows > 1 && rows * width >= kParallelValues;
}

// Row [count] of `base` at `offset`, as float32, into out.
[[maybe_unused]] SSSD_CLONES void to_float(const void* base, int64_t offset, int64_t count, Dtype dtype,
                          float* out) {
  if (dtype == Dtype::kFloat32) {
    std::memcpy(out, static_cast<const float*>(base) + offset, count * sizeof(float));
    return;
  }
  const uint16_t* in = static_cast<const uint16_t*>(base) + offset;
  for (int64_t i = 0; i < count; ++i) {
    uint32_t wide = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &wide, sizeof(float));
  }
}

[[maybe_unused]] SSSD_CLONES void from_float(const float* in, int64_t count, Dtype dtype, void* base,
                            int64_t offset) {
  if (dtype == Dtype::kFloat32) {
    std::memcpy(static_cast<float*>(base) + offset, in, count * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(base) + offset;
  for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(in[i]);
}

// q . k over n values, in kDotLanes partial sums (element d into sum d % kDotLanes, the sums
// then added in order): a loop the compiler vectorizes, which a single running sum is not
// without -ffast-math.
constexpr int64_t kDotLanes = 8;

[[maybe_unused]] SSSD_CLONES float dot(const float* q, const float* k, int64_t n) {
  float lanes[kDotLanes] = {};
  const int64_t body = n - n % kDotLanes;
  for (int64_t d = 0; d < body; d += kDotLanes) {
    for (int64_t l = 0; l < kDotLanes; ++l) lanes[l] += q[d + l] * k[d + l];
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kDotLanes; ++l) sum += lanes[l];
  for (int64_t d = body; d < n; ++d) sum += q[d] * k[d];
  return sum;
}

// y += a x over n values.
[[maybe_unused]] SSSD_CLONES void add_scaled(float* y, float a, const float* x, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] += a * x[d];
}

}  // namespace
}  // namespace sssd::kernels::detail
