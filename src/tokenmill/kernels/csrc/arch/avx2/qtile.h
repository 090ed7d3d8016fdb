// The quantized formats' register tiles on ymm registers (AVX2 with F16C: every x86 variant; with AVX-512 VNNI or
// AVX-VNNI, vpdpbusd in place of vpmaddubsw + vpmaddwd). linear/qpanel.h picks this file; the sums are exact
// integers either way (linear/quant.h says how), so every variant gives the same bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "arch/isa.h"
#include "core/cpu.h"
#include "core/vec.h"
#include "linear/format.h"
#include "linear/qrow.h"

#if !TM_INT8_YMM
#error "arch/avx2/qtile.h needs AVX2 and F16C (-mavx2 -mf16c)"
#endif

namespace tmk {

#if TM_REGS32
inline const bool prefetch_quant_rows = !amd_avx512;
#else
inline const bool prefetch_quant_rows = true;
#endif

// Q4_0: MT rows' exact integer sums over the block at q (its 8 groups of 32 bytes) -> isum[m][0] channels 0-7,
// isum[m][1] 8-15, the row's -8 * (sum of its q) included (QRow::o)
template <int MT>
inline void q4_block_sums(const uint8_t* q, const QRow* x, int64_t b, __m256i (*isum)[2]) {
  const __m256i low = _mm256_set1_epi8(15);
  __m256i p[MT][2];
  for (int m = 0; m < MT; ++m) {
#if TM_VNNI  // the sums start at the offsets; the high half's at 16 times its own
    p[m][0] = _mm256_set1_epi32(x[m].o[2 * b]), p[m][1] = _mm256_set1_epi32(x[m].o[2 * b + 1]);
#else  // 16-bit sums: the offset comes after they widen
    p[m][0] = p[m][1] = _mm256_setzero_si256();
#endif
  }
  // NOTE: the AVX2 build, unrolled whole, computes every product first and spills them to the stack; the avxvnni
  // one spills its accumulators on every pass of a loop unrolled by 2 from 4 rows on
#if TM_WIDE
#pragma GCC unroll 8
#else
#pragma GCC unroll 2
#endif
  for (int g = 0; g < QK / 4; ++g) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i*)(q + g * 32));
#if TM_VNNI
    // the high nibbles in place, 16 times their weight (no 16-bit sums to overflow here): shifted out below
    const __m256i w0 = _mm256_and_si256(bytes, low), w1 = _mm256_andnot_si256(low, bytes);
#else
    const __m256i w0 = _mm256_and_si256(bytes, low), w1 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
#endif
    for (int m = 0; m < MT; ++m) {
      int32_t four;
      std::memcpy(&four, x[m].q + b * QK + 4 * g, 4);
      const __m256i xb = _mm256_set1_epi32(four);
#if TM_VNNI
      p[m][0] = tm_dpbusd256(p[m][0], w0, xb);  // 32-bit sums of 4 products at once
      p[m][1] = tm_dpbusd256(p[m][1], w1, xb);
#else
      p[m][0] = _mm256_add_epi16(p[m][0], _mm256_maddubs_epi16(w0, xb));
      p[m][1] = _mm256_add_epi16(p[m][1], _mm256_maddubs_epi16(w1, xb));
#endif
    }
  }
  for (int m = 0; m < MT; ++m) {
#if TM_VNNI
    isum[m][0] = p[m][0];
    isum[m][1] = _mm256_srai_epi32(p[m][1], 4);  // exact: 16 * (sum - 8 s), |sum - 8 s| < 2^16
#else
    const __m256i ones = _mm256_set1_epi16(1), offset = _mm256_set1_epi32(x[m].o[2 * b]);
    for (int h = 0; h < 2; ++h) isum[m][h] = _mm256_add_epi32(_mm256_madd_epi16(p[m][h], ones), offset);
#endif
  }
}

#if TM_VNNI
// Q8_0: MT rows' sums += (x + 128) at group g of block b (QRow::u) times the group's weights (w0 channels 0-7, w1
// 8-15)
template <int MT>
inline void q8_group(const QRow* x, int64_t b, int g, __m256i w0, __m256i w1, __m256i (*isum)[2]) {
  for (int m = 0; m < MT; ++m) {
    int32_t four;
    std::memcpy(&four, x[m].u + b * QK + 4 * g, 4);
    const __m256i xu = _mm256_set1_epi32(four);
    isum[m][0] = tm_dpbusd256(isum[m][0], xu, w0);
    isum[m][1] = tm_dpbusd256(isum[m][1], xu, w1);
  }
}
#endif

// MT rows x the panel's 16 channels -> sums[m][0..16) = sum over the blocks of isum * (d_w * d_x), over blocks
// [b0, b1): from zero at b0 = 0, else on from `sums`; `prefetch`: ask for the weights ahead (qpanel's first tile)
template <Format F, int MT>
inline void qtile(const uint8_t* panel, const QRow* x, int64_t b0, int64_t b1, float (*sums)[P], bool prefetch) {
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = b0 ? _mm256_loadu_ps(sums[m] + 8 * h) : _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // (vpmaddwd's; VNNI needs none)
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = panel + b * quant_block_bytes(F);
    // the weights ahead, as linear/common.h's prefetch_ahead. Not on a Zen 4, whose AVX-512 build takes only 1-3
    // rows here: those stream best on the hardware's prefetch alone, as the one-row bf16 pair tile does there
    if (prefetch_quant_rows && prefetch)
      for (int64_t off = 0; off < quant_block_bytes(F); off += 64) prefetch_weights(blk + off);
    const uint8_t* q = blk + 2 * P;
    __m256i isum[MT][2];
    if constexpr (F == Q4_0) {
      q4_block_sums<MT>(q, x, b, isum);
    } else {
      for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
#if TM_VNNI
      // x + 128 (QRow::u, unsigned) times w (signed), less 128 * the block's sum of w per channel (itself one
      // vpdpbusd by ones per group, shared by the tile's rows): the same exact sums, without a vpsignb per row
      __m256i wsum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      const __m256i ones8 = _mm256_set1_epi8(1);
#pragma GCC unroll 2
      for (int g = 0; g < QK / 4; ++g) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(q + g * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(q + g * 64 + 32));
        wsum[0] = tm_dpbusd256(wsum[0], ones8, w0);
        wsum[1] = tm_dpbusd256(wsum[1], ones8, w1);
        q8_group<MT>(x, b, g, w0, w1, isum);
      }
      const __m256i c0 = _mm256_slli_epi32(wsum[0], 7), c1 = _mm256_slli_epi32(wsum[1], 7);
      for (int m = 0; m < MT; ++m) {
        isum[m][0] = _mm256_sub_epi32(isum[m][0], c0);
        isum[m][1] = _mm256_sub_epi32(isum[m][1], c1);
      }
#else
#pragma GCC unroll 2
      for (int g = 0; g < QK / 4; ++g) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(q + g * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(q + g * 64 + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int m = 0; m < MT; ++m) {
          int32_t four;
          std::memcpy(&four, x[m].q + b * QK + 4 * g, 4);
          const __m256i xb = _mm256_set1_epi32(four);
          const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
          const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
          isum[m][0] = _mm256_add_epi32(isum[m][0], _mm256_madd_epi16(p0, ones));
          isum[m][1] = _mm256_add_epi32(isum[m][1], _mm256_madd_epi16(p1, ones));
        }
      }
#endif
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)));
    for (int m = 0; m < MT; ++m) {
      const __m256 dx = _mm256_set1_ps(x[m].d[b]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][0]), _mm256_mul_ps(d0, dx), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][1]), _mm256_mul_ps(d1, dx), acc[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(sums[m], acc[m][0]);
    _mm256_storeu_ps(sums[m] + 8, acc[m][1]);
  }
}

}  // namespace tmk
