// The vector layer's ISA-specific operations with AVX2 instructions, 8 lanes (the avx2 and avxvnni variants).
// core/simd.h picks this file.
#pragma once

#include <cstdint>

#include "core/vec.h"

#if !TM_SIMD_AVX2
#error "arch/avx2/simd.h is for 8-lane builds with AVX2 (TM_W=8, -mavx2)"
#endif

namespace tmk {

inline vf splat(float x) { return (vf)_mm256_set1_ps(x); }

// W bfloat16 values -> W floats: a bf16 is the top half of a float's bits. The ISA's widening load: GCC 12 turns a
// generic narrow-to-float vector conversion into scalar code.
inline vf load_bf16(const uint16_t* p) {
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// The high bf16 of each 32-bit lane as a float (lanes & 0xffff0000), the mask read by the and from memory
// (core/simd.h: load_bf16_half_tight). Held in a register, the mask is the 16th ymm of a 6-row bf16 tile (12 sums, 2
// weights, a broadcast), and GCC spilled one of the sums instead, its store and reload inside its chain of FMAs
inline vf bf16_high(vu lanes) {
  alignas(32) static const uint32_t high[8] = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                                               0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};
  __m256 out;
  asm("vandps %1, %2, %0" : "=x"(out) : "m"(*(const __m256*)high), "x"((__m256)lanes));
  return (vf)out;
}

// W int8 values -> W floats (the int8 KV cache's rows)
inline vf load_i8(const int8_t* p) {
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// W bytes -> W 32-bit lanes (the fp8 KV cache's rows)
inline vu load_u8(const uint8_t* p) { return (vu)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

// the sum of v's lanes: halves added in a tree (a scalar chain of W adds is far slower where decode attention takes
// one sum per position and head)
inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// the largest of v's lanes (none a NaN), in a tree as hsum (the prefill softmax's block maxima)
inline float hmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// {hsum(a), hsum(b), hsum(c), hsum(d)} -> out[0..4): one shuffle tree for the four (decode attention's scores)
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  // per 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3] and c's, d's; then [sum a, sum b, sum c, sum d]
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a, (__m256)b), _mm256_hadd_ps((__m256)c, (__m256)d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

// whether any lane of v is a NaN
inline bool any_nan(vf v) { return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q)) != 0; }

// whether any lane of a comparison's mask is set: one test (lane by lane, GCC extracts each)
inline bool any_lane(vi mask) { return !_mm256_testz_si256((__m256i)mask, (__m256i)mask); }

}  // namespace tmk
