// The activation quantizer's block step with AVX2 (every x86 variant). linear/qrow.h picks this file.
#pragma once

#include <cstdint>

#include "arch/isa.h"

#if !defined(__AVX2__)
#error "arch/avx2/quantize.h needs AVX2 (-mavx2)"
#endif

namespace tmk {

// One block of 32 activations: max |x|
inline float block_amax(const float* xb) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

// One block of 32 activations -> q[0..32) int8 at the scale d = amax / 127 (amax: the block's, or its group's):
// q = x / d rounded to nearest, ties to even (as ggml's AVX2 quantize_row_q8_0). Returns the block's sum of q.
inline int32_t quantize_block(const float* xb, int8_t* q, float d) {
  const float id = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  __m256i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), _mm256_set1_ps(id)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  int32_t lanes[8];
  _mm256_storeu_si256((__m256i*)lanes, total);
  for (int i = 0; i < 8; ++i) sum += lanes[i];
  // int32 -> int8: the packs interleave 128-bit lanes; the permute puts the 8 groups of 4 back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256((__m256i*)q,
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return sum;
}

}  // namespace tmk
