// The avxvnni build's wide quantized tiles: from 4 rows on, each row's float sums wait in `sums` (L1) from block to
// block, so that the 16 ymm registers hold 6 rows' integer sums and each group's weights, loaded (and for Q4_0
// unpacked) once, serve them all. arch/avx2/qtile.h's tiles of 3 keep their float sums in registers, which leaves room for 3
// rows only.
//
// The integer sums and their scaling are qtile's, so the outputs are the same bits:
//   Q4_0: q4_block_sums (the sums start at the row's offsets, QRow::o);
//   Q8_0: (x + 128, unsigned: QRow::u) times w, less 128 * the block's sum of w per channel. Those sums come
//         first, for all of a panel's blocks at once (q8_corrections), and each row's sums start at -128 times them:
//         the tiles of 3 compute them again in every tile, with one vpdpbusd per group and half.
//
// The AVX2 build keeps tiles of 3: its 16-bit sums need a register more per row, and wide tiles there were slower.
//
// linear/quant.h picks this file's quant_panel for the avxvnni variant.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "arch/avx2/qtile.h"
#include "arch/isa.h"
#include "core/cpu.h"
#include "linear/format.h"
#include "linear/qpanel.h"
#include "linear/qrow.h"

#if !TM_WIDE
#error "arch/avxvnni/qwide.h is the avxvnni variant's (VNNI on 8 lanes)"
#endif

namespace tmk {

constexpr int MT_WIDE = 6;  // rows per wide tile (4 or 5 gained less)

// sums[m] += isum[m] * (d_w * d_x[m]) for one block at blk (its 16 fp16 scales first)
template <int MT>
inline void scale_block(const uint8_t* blk, const QRow* x, int64_t b, const __m256i (*isum)[2], float (*sums)[P]) {
  const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
  const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)));
  for (int m = 0; m < MT; ++m) {
    const __m256 dx = _mm256_set1_ps(x[m].d[b]);
    _mm256_storeu_ps(sums[m], _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][0]), _mm256_mul_ps(d0, dx),
                                              _mm256_loadu_ps(sums[m])));
    _mm256_storeu_ps(sums[m] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][1]), _mm256_mul_ps(d1, dx),
                                                  _mm256_loadu_ps(sums[m] + 8)));
  }
}

// Q8_0: -128 * (the sum of w per channel) for each of a panel's nb blocks -> corr [nb][16], once for all its tiles
inline void q8_corrections(const uint8_t* panel, int64_t nb, int32_t* corr) {
  const __m256i ones8 = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = panel + b * quant_block_bytes(Q8_0) + 2 * P;
    __m256i c[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8
    for (int g = 0; g < QK / 4; ++g) {
      c[0] = tm_dpbusd256(c[0], ones8, _mm256_loadu_si256((const __m256i*)(q + g * 64)));
      c[1] = tm_dpbusd256(c[1], ones8, _mm256_loadu_si256((const __m256i*)(q + g * 64 + 32)));
    }
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_si256((__m256i*)(corr + b * P + 8 * h),
                          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(c[h], 7)));
  }
}

// Q8_0: one block's exact integer sums for MT rows, from the block's corrections (corr: 16 int32)
template <int MT>
inline void q8_block_sums(const uint8_t* q, const int32_t* corr, const QRow* x, int64_t b, __m256i (*isum)[2]) {
  const __m256i c0 = _mm256_loadu_si256((const __m256i*)corr), c1 = _mm256_loadu_si256((const __m256i*)(corr + 8));
  for (int m = 0; m < MT; ++m) isum[m][0] = c0, isum[m][1] = c1;
#pragma GCC unroll 8
  for (int g = 0; g < QK / 4; ++g)
    q8_group<MT>(x, b, g, _mm256_loadu_si256((const __m256i*)(q + g * 64)),
                 _mm256_loadu_si256((const __m256i*)(q + g * 64 + 32)), isum);
}

// MT rows x the panel's 16 channels -> sums[m][0..16), as qtile; corr: Q8_0's q8_corrections
template <Format F, int MT>
inline void qtile_wide(const uint8_t* panel, const int32_t* corr, const QRow* x, int64_t nb, float (*sums)[P]) {
  for (int m = 0; m < MT; ++m) std::fill(sums[m], sums[m] + P, 0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * quant_block_bytes(F);
    for (int64_t off = 0; off < quant_block_bytes(F); off += 64) prefetch_weights(blk + off);
    __m256i isum[MT][2];
    if constexpr (F == Q4_0) q4_block_sums<MT>(blk + 2 * P, x, b, isum);
    else q8_block_sums<MT>(blk + 2 * P, corr + b * P, x, b, isum);
    scale_block<MT>(blk, x, b, isum, sums);
  }
}

// A panel times mc rows: from MT_Q + 1 rows in the wide tiles, fewer in qpanel's tiles of MT_Q
template <Format F>
inline void quant_panel(const uint8_t* panel, const QRow* x, int64_t nb, float (*sums)[P], int64_t mc) {
  if (mc > MT_Q) {
    // the rows in the fewest tiles of at most MT_WIDE (16 rows as 6 + 6 + 4)
    const int64_t tiles = (mc + MT_WIDE - 1) / MT_WIDE, per = (mc + tiles - 1) / tiles;
    thread_local std::vector<int32_t> corr;
    if (F == Q8_0) corr.resize(nb * P), q8_corrections(panel, nb, corr.data());
    for (int64_t m = 0; m < mc; m += per)
      with_rows<MT_WIDE>(std::min<int64_t>(per, mc - m), [&](auto r) {
        constexpr int R = decltype(r)::value;
        if constexpr (R <= MT_Q) qtile<F, R>(panel, x + m, 0, nb, sums + m, true);
        else qtile_wide<F, R>(panel, corr.data(), x + m, nb, sums + m);
      });
    return;
  }
  qpanel<F>(panel, x, nb, sums, mc);
}

}  // namespace tmk
