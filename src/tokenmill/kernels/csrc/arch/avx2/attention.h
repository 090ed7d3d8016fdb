// Prefill's key panels with AVX2 (the avx2 and avxvnni variants): attention/decode.h picks this file through
// arch/generic/attention.h, whose decode attention these builds take.
#pragma once

#include <cstdint>

#include "arch/isa.h"

#if !TM_SIMD_AVX2
#error "arch/avx2/attention.h is for 8-lane builds with AVX2 (TM_W=8, -mavx2)"
#endif

namespace tmk {

// r[i] (row i: 8 words) -> r[j] (word j of the 8 rows): the 8 x 8 transpose of 32-bit words
inline void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);      // rows i, i+1: words 0 1 | 4 5, interleaved
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);  // words 2 3 | 6 7
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      u[i + h] = _mm256_unpacklo_epi64(t[i + h], t[i + h + 2]);      // rows i..i+3: word 2h | 4+2h
      u[i + h + 2] = _mm256_unpackhi_epi64(t[i + h], t[i + h + 2]);  // word 2h+1 | 5+2h
    }
  // u[0]: word 0|4 of rows 0-3, u[2]: 1|5, u[1]: 2|6, u[3]: 3|7; u[4..8) the same of rows 4-7
  const int word[4] = {0, 2, 1, 3};
  for (int k = 0; k < 4; ++k) {
    r[word[k]] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);      // word w of rows 0-3, then of rows 4-7
    r[word[k] + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);  // word w + 4
  }
}

// prefill's pack_keys for a bf16 cache (Dh a multiple of 16; false, and nothing done, otherwise): m <= 16 keys (row
// pointers) -> dst [Dh/2][16] words, each panel row one pair of the 16 keys, transposed 8 x 8 in registers
inline bool pack_keys_bf16(const uint16_t* const* key, int64_t m, int64_t Dh, uint32_t* dst) {
  if (Dh % 16 != 0) return false;
  for (int64_t c = 0; c < Dh; c += 16)    // 8 pairs of each key
    for (int64_t half = 0; half < 2; ++half) {  // keys 0-7, then 8-15
      __m256i r[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t k = half * 8 + i;
        r[i] = k < m ? _mm256_loadu_si256((const __m256i*)(key[k] + c)) : _mm256_setzero_si256();
      }
      transpose8(r);  // r[j]: pair c/2 + j of the 8 keys
      for (int j = 0; j < 8; ++j) _mm256_storeu_si256((__m256i*)(dst + (c / 2 + j) * 16 + half * 8), r[j]);
    }
  return true;
}

}  // namespace tmk
