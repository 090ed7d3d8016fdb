// The vector layer's ISA-specific operations with AVX-512 instructions, 16 lanes (the avx512 and avx512bf16
// variants). core/simd.h picks this file.
#pragma once

#include <cstdint>

#include "core/vec.h"

#if !TM_SIMD_AVX512 || !defined(__AVX512DQ__)
#error "arch/avx512/simd.h is for 16-lane builds with AVX-512 F and DQ (TM_W=16, kernels/isa.py)"
#endif

namespace tmk {

inline vf splat(float x) { return (vf)_mm512_set1_ps(x); }

// W bfloat16 values -> W floats: a bf16 is the top half of a float's bits. The ISA's widening load: GCC 12 turns a
// generic narrow-to-float vector conversion into scalar code.
inline vf load_bf16(const uint16_t* p) {
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// W int8 values -> W floats (the int8 KV cache's rows)
inline vf load_i8(const int8_t* p) {
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// W bytes -> W 32-bit lanes (the fp8 KV cache's rows)
inline vu load_u8(const uint8_t* p) { return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }

// the sum of v's lanes, in a tree (a scalar chain of W adds is far slower where decode attention takes one sum per
// position and head)
inline float hsum(vf v) { return _mm512_reduce_add_ps((__m512)v); }

// the largest of v's lanes (none a NaN)
inline float hmax(vf v) { return _mm512_reduce_max_ps((__m512)v); }

// {hsum(a), hsum(b), hsum(c), hsum(d)} -> out[0..4): one shuffle tree for the four (decode attention's scores)
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  auto half = [](vf v) {
    return _mm256_add_ps(_mm512_castps512_ps256((__m512)v), _mm512_extractf32x8_ps((__m512)v, 1));
  };
  // per 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3] and c's, d's; then [sum a, sum b, sum c, sum d]
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

// whether any lane of v is a NaN
inline bool any_nan(vf v) { return _mm512_cmp_ps_mask((__m512)v, (__m512)v, _CMP_UNORD_Q) != 0; }

// whether any lane of a comparison's mask is set: one test (lane by lane, GCC extracts each)
inline bool any_lane(vi mask) { return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0; }

}  // namespace tmk
