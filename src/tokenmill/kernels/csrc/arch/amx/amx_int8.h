// Q8_0 / Q4_0 weights on AMX-INT8: one TDPBSSD multiplies up to 16 quantized rows of x by a 32-k block of a
// panel, into 16 x 16 exact int32 sums held in a tile register. A Q8_0 block's groups of 4 k per channel
// ([8][16][4] int8, linear/format.h) are the B operand as stored: 8 rows of 64 bytes. A Q4_0 block's nibbles are unpacked
// into the same layout, less 8 (signed -8..7), once per block for all the rows. x's quantized rows (QRow, linear/qrow.h)
// are A, 32 bytes of each row, read in place.
//
// Each block has its own scales (one per channel, one per row), so every block's sums leave the tiles: they are
// stored, and each row's vector of 16 becomes acc += float(isum) * (d_w * d_x), the very operations of the VNNI
// tile (qtile) in the same order. The integer sums are exact either way, so the outputs are the same bits as the
// VNNI path's, and a row's output still does not depend on the batch.
#pragma once

#include <algorithm>
#include <cstdint>

#include "arch/amx/tiles.h"
#include "arch/isa.h"
#include "core/vec.h"
#include "linear/common.h"
#include "linear/format.h"
#include "linear/qrow.h"

namespace tmk {

// Q4_0 block values (8 groups of 32 bytes: channel c in the low nibble, c + 8 in the high one) -> dst[8][64]:
// group g's 4 k of channels 0..15, less 8
inline void unpack_q4_block(const uint8_t* q, int8_t* dst) {
  const __m512i low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
  for (int g = 0; g < QK / 4; g += 2) {
    const __m512i bytes = _mm512_loadu_si512((const void*)(q + g * 32));  // groups g and g + 1
    const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(bytes, low), eight);
    const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low), eight);
    _mm512_storeu_si512((void*)(dst + g * 64), _mm512_shuffle_i64x2(lo, hi, 0x44));  // lo's g, then hi's g
    _mm512_storeu_si512((void*)(dst + (g + 1) * 64), _mm512_shuffle_i64x2(lo, hi, 0xEE));
  }
}

// Tiles 0, 1: sums of row block 0 by panels 0, 1 (r0 x 16 int32); 2, 3: row block 1's; 4, 5: A, 32 bytes of each
// row of blocks 0, 1; 6, 7: B, a block's 8 rows of 16 channels x 4 k of panels 0, 1.
__attribute__((target("amx-tile,amx-int8"))) inline void amx_configure_q(int r0, int r1) {
  TileConfig c;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, QK / 4, QK / 4};
  const int cols[8] = {64, 64, 64, 64, QK, QK, 64, 64};
  for (int t = 0; t < 8; ++t) c.rows[t] = (uint8_t)rows[t], c.colsb[t] = rows[t] ? cols[t] : 0;
  asm volatile("" : : "r"(&c) : "memory");  // the config's stores kept: see amx_configure, arch/amx/amx_bf16.h
  _tile_loadconfig(&c);
}

// acc[b][q][m][0..16) = x's rows (RB row blocks of rows[b], as configured) times panels w[0..PB) over nb blocks.
// xq: the first row's values (row stride xs bytes), xd: its block scales (row stride ldx floats).
template <Format F, int RB, int PB>
__attribute__((target("amx-tile,amx-int8"))) inline void amx_q_pass(const int8_t* xq, int64_t xs, const float* xd,
                                                                     int64_t ldx, const uint8_t* const* w,
                                                                     int64_t nb, const int* rows,
                                                                     float (*acc)[2][16][P]) {
  alignas(64) int32_t c[2][2][16][P];
  alignas(64) int8_t unpacked[2][QK / 4][64];
  for (int b = 0; b < RB; ++b)
    for (int q = 0; q < PB; ++q)
      for (int m = 0; m < rows[b]; ++m) _mm512_store_ps(acc[b][q][m], _mm512_setzero_ps());
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* blk[2] = {w[0] + j * quant_block_bytes(F), w[PB - 1] + j * quant_block_bytes(F)};
    const void* wq[2] = {blk[0] + 2 * P, blk[1] + 2 * P};
    if constexpr (F == Q4_0)
      for (int q = 0; q < PB; ++q) unpack_q4_block(blk[q] + 2 * P, unpacked[q][0]), wq[q] = unpacked[q];
    _tile_zero(0);
    _tile_loadd(4, xq + j * QK, xs);
    _tile_loadd(6, wq[0], 64);
    _tile_dpbssd(0, 4, 6);
    if constexpr (RB == 2) {
      _tile_zero(2);
      _tile_loadd(5, xq + 16 * xs + j * QK, xs);
      _tile_dpbssd(2, 5, 6);
    }
    if constexpr (PB == 2) {
      _tile_zero(1);
      _tile_loadd(7, wq[1], 64);
      _tile_dpbssd(1, 4, 7);
      if constexpr (RB == 2) {
        _tile_zero(3);
        _tile_dpbssd(3, 5, 7);
      }
    }
    _tile_stored(0, c[0][0], 64);
    if constexpr (PB == 2) _tile_stored(1, c[0][1], 64);
    if constexpr (RB == 2) _tile_stored(2, c[1][0], 64);
    if constexpr (RB == 2 && PB == 2) _tile_stored(3, c[1][1], 64);
    for (int q = 0; q < PB; ++q) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk[q]));
      for (int b = 0; b < RB; ++b)
        for (int m = 0; m < rows[b]; ++m) {
          const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[(16 * b + m) * ldx + j]));
          const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)c[b][q][m]));
          _mm512_store_ps(acc[b][q][m], _mm512_fmadd_ps(isum, scale, _mm512_load_ps(acc[b][q][m])));
        }
    }
  }
}

// The rows of one pass (rows[b] in each of rb row blocks, from row m0) by its panels p, p + 1 (pb of them): their
// float sums acc into out (the quantized passes' common tail: this file's and amx_kquant.h's)
inline void amx_store_pass(float (*acc)[2][16][P], const int* rows, int rb, int pb, int64_t m0, int64_t p, int64_t N,
                           const float* bias, float* out32, uint16_t* out16) {
  for (int b = 0; b < rb; ++b)
    for (int q = 0; q < pb; ++q) {
      const int64_t n0 = (p + q) * P, n_valid = std::min<int64_t>(P, N - n0);
      for (int m = 0; m < rows[b]; ++m) store_outputs(acc[b][q][m], m0 + 16 * b + m, n0, n_valid, N, bias, out32, out16);
    }
}

// Output panels [p_begin, p_end) of out[M, N] = x[M, K] @ w^T (+ bias) for a Q8_0 or Q4_0 weight, x rows in the
// QRow layout `ldx` floats apart (as linear_quant): 32 rows by 2 panels at a time.
template <Format F>
__attribute__((target("amx-tile,amx-int8"))) void linear_amx_q(const float* x, int64_t M, int64_t ldx,
                                                                const uint8_t* packed, int64_t N, int64_t K,
                                                                const float* bias, float* out32, uint16_t* out16,
                                                                int64_t p_begin, int64_t p_end) {
  const int64_t nb = K / QK, stride = panel_bytes(F, K), xs = ldx * 4;
  alignas(64) float acc[2][2][16][P];
  int configured[2] = {-1, -1};
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int rows[2] = {(int)std::min<int64_t>(16, M - m0), (int)std::clamp<int64_t>(M - m0 - 16, 0, 16)};
    if (rows[0] != configured[0] || rows[1] != configured[1])
      amx_configure_q(rows[0], rows[1]), configured[0] = rows[0], configured[1] = rows[1];
    const float* xr = x + m0 * ldx;
    const int8_t* xq = qrow(xr, nb).q;
    for (int64_t p = p_begin; p < p_end; p += 2) {
      const uint8_t* w[2] = {packed + p * stride, packed + (p + 1) * stride};
      const int pb = p + 1 < p_end ? 2 : 1, rb = rows[1] ? 2 : 1;
      if (rb == 2 && pb == 2) amx_q_pass<F, 2, 2>(xq, xs, xr, ldx, w, nb, rows, acc);
      else if (rb == 2) amx_q_pass<F, 2, 1>(xq, xs, xr, ldx, w, nb, rows, acc);
      else if (pb == 2) amx_q_pass<F, 1, 2>(xq, xs, xr, ldx, w, nb, rows, acc);
      else amx_q_pass<F, 1, 1>(xq, xs, xr, ldx, w, nb, rows, acc);
      amx_store_pass(acc, rows, rb, pb, m0, p, N, bias, out32, out16);
    }
  }
  _tile_release();
}

}  // namespace tmk
