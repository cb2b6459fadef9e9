// Sixteen float32 values from a row of the model's dtype, for the files compiled with AVX-512
// (the AVX-512 attention, argmax_avx512.cc); bfloat16 widens exactly (its bits are float32's top
// half).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sssd::kernels::detail {

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<uint16_t>(const uint16_t* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

}  // namespace sssd::kernels::detail
