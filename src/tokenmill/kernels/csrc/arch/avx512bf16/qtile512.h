// The quantized tiles with AVX-512 VNNI: one zmm register holds a panel's 16 channels at 4 k each, so one
// vpdpbusd does 64 of a block's products for one row (the AVX2-width tiles in arch/avx2/qtile.h take two ymm registers and
// two instructions for the same, and run out of registers at 8 rows).
//
// The integer sums and their scaling are arch/avx2/qtile.h's, lane for lane, so the outputs are the same bits:
//   Q8_0: (x + 128, unsigned: QRow::u) times w, less 128 * the block's sum of w per channel (one vpdpbusd by ones
//         per group, shared by the tile's rows);
//   Q4_0: the block's 32 bytes hold channels 0-7 in their low nibbles and 8-15 in their high ones, so one
//         broadcast to both halves of a zmm and one mask (0x0F below, 0xF0 above) give the 16 channels' 4-bit
//         weights (unsigned; the upper 8 times 16) for the row's signed bytes. The upper sums are shifted right
//         by 4 once per block, and 8 * (the row's sum of q over the block) comes off.
// Each block's int32 sums are then scaled by d_w * d_x and added to the row's float sums.
//
// Tiles of 8 rows (12 gained nothing more). From 1 to 3 rows a Zen 4 keeps the ymm tiles (arch/avx2/qtile.h: one
// row is bound by memory, and its sums wait on vpdpbusd's latency there); an Intel core, whose zmm units are full
// width, takes these, as does a Zen 5 (core/cpu.h).
//
// linear/quant.h picks this file's quant_panel where the build has AVX-512 VNNI (the avx512bf16 variant).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "arch/avx512bf16/dp_broadcast.h"
#include "arch/isa.h"
#include "core/cpu.h"
#include "linear/format.h"
#include "linear/qpanel.h"
#include "linear/qrow.h"

#if !TM_Q512
#error "arch/avx512bf16/qtile512.h needs 16 lanes with AVX-512 BW and VNNI (the avx512bf16 variant)"
#endif

namespace tmk {

constexpr int MT_Q512 = 8;  // rows per tile (from 1 on Intel, from 4 on a Zen 4; linear_quant)

template <Format F, int MT>
inline void qtile512(const uint8_t* panel, const QRow* x, int64_t nb, float (*sums)[P]) {
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  [[maybe_unused]] const __m512i ones8 = _mm512_set1_epi8(1);
  // channels 0-7 from the low nibbles, 8-15 from the high ones left in place: 16 times their weight, so their sums
  // are 16 times too (shifted out below, exactly)
  [[maybe_unused]] const __m512i nibbles = _mm512_inserti64x4(_mm512_set1_epi8(15), _mm256_set1_epi8((char)0xF0), 1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * quant_block_bytes(F);
    for (int64_t off = 0; off < quant_block_bytes(F); off += 64) prefetch_weights(blk + off);
    const uint8_t* q = blk + 2 * P;
    __m512i isum[MT];
    for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
    [[maybe_unused]] __m512i wsum = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int g = 0; g < QK / 4; ++g) {
      __m512i w;
      if constexpr (F == Q8_0) {
        w = _mm512_loadu_si512((const void*)(q + g * 64));  // [16 channels][4 k], signed
        wsum = _mm512_dpbusd_epi32(wsum, ones8, w);
      } else {
        // [channels 0-7 | channels 8-15] x 4 k: the group's 32 bytes twice, low nibbles and high ones
        w = _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(q + g * 32))), nibbles);
      }
      for (int m = 0; m < MT; ++m) {
        if constexpr (F == Q8_0) {
          int32_t four;
          std::memcpy(&four, x[m].u + b * QK + 4 * g, 4);
          isum[m] = _mm512_dpbusd_epi32(isum[m], _mm512_set1_epi32(four), w);
        } else {  // (Q8_0's broadcast is vpdpbusd's unsigned operand, which takes no memory)
          isum[m] = dpbusd_broadcast(isum[m], w, x[m].q + b * QK + 4 * g);
        }
      }
    }
    if constexpr (F == Q4_0)  // channels 8-15: 16 * sum, |sum| < 2^16, so the shift is exact
      for (int m = 0; m < MT; ++m) isum[m] = _mm512_mask_srai_epi32(isum[m], 0xFF00, isum[m], 4);
    const __m512i correction = F == Q8_0 ? _mm512_slli_epi32(wsum, 7) : _mm512_setzero_si512();
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    for (int m = 0; m < MT; ++m) {
      const __m512i total = F == Q8_0 ? _mm512_sub_epi32(isum[m], correction)
                                      : _mm512_add_epi32(isum[m], _mm512_set1_epi32(x[m].o[2 * b]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x[m].d[b]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(sums[m], acc[m]);
}

// A panel times mc rows: the rows in the fewest tiles, of even sizes (12 rows as 6 + 6, not 8 + 4); 1-3 rows in the
// ymm tiles on a Zen 4, the zmm ones on Intel and Zen 5 (see the top)
template <Format F>
inline void quant_panel(const uint8_t* panel, const QRow* x, int64_t nb, float (*sums)[P], int64_t mc) {
  const int64_t tiles = (mc + MT_Q512 - 1) / MT_Q512, per = (mc + tiles - 1) / tiles;
  for (int64_t m = 0; m < mc; m += per) {
    const int64_t rows = std::min<int64_t>(per, mc - m);
    if (rows < 4 && amd_half_width_512) qtile_rows<F, 3>(panel, x + m, nb, sums + m, rows);
    else with_rows<MT_Q512>(rows, [&](auto r) { qtile512<F, decltype(r)::value>(panel, x + m, nb, sums + m); });
  }
}

}  // namespace tmk
