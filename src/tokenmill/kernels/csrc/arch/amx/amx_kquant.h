// The K family (linear/kformat.h) on AMX-INT8, but for the K-quants proper, which take a superblock at a time
// (arch/amx/amx_ksuper.h): a block of 32 k of a panel is unpacked once into 8 rows of 16 channels x 4 k (each byte
// the channel's v(q): kgroup512, the very bytes the VNNI tile multiplies), and one TDPBSSD or, for IQ4's unsigned
// table values (1..241), TDPBSUD multiplies up to 16 quantized rows of x (QRow, read in place) by it into exact
// int32 sums, 16 x 16 in a tile register.
//
// The sums leave the tiles per sub-block and are scaled into each row's float sums by kfinish512, the function the
// VNNI tile (arch/avx512bf16/ktile512.h) calls, in the same order: the integer sums are exact either way, so a row's
// outputs are the same bits on either path, and do not depend on the batch.
//
// Tiles 0, 1: sums of row block 0 by panels 0, 1; 2, 3: row block 1's; 4, 5: A, the rows' bytes of a sub-block;
// 6, 7: B, a sub-block's groups of panels 0, 1.
#pragma once

#include <algorithm>
#include <cstdint>

#include "arch/amx/amx_int8.h"
#include "arch/amx/amx_ksuper.h"
#include "arch/amx/tiles.h"
#include "arch/avx512bf16/ktile512.h"
#include "arch/isa.h"
#include "linear/common.h"
#include "linear/format.h"
#include "linear/kformat.h"
#include "linear/qrow.h"

// tile c += tile a (the rows' signed bytes) x tile b (a sub-block's v(q)): the tile numbers are the instruction's
// immediates, hence a macro
#define TM_AMX_KDOT(F, c, a, b)                          \
  do {                                                   \
    if constexpr (kspec(F).table) _tile_dpbsud(c, a, b); \
    else _tile_dpbssd(c, a, b);                          \
  } while (0)

namespace tmk {

template <Format F>
__attribute__((target("amx-tile,amx-int8"))) inline void amx_configure_k(int r0, int r1) {
  constexpr int KB = kspec(F).sub;  // bytes of a row per product: a sub-block's k
  TileConfig c;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, KB / 4, KB / 4};
  const int cols[8] = {64, 64, 64, 64, KB, KB, 64, 64};
  for (int t = 0; t < 8; ++t) c.rows[t] = (uint8_t)rows[t], c.colsb[t] = rows[t] ? cols[t] : 0;
  asm volatile("" : : "r"(&c) : "memory");  // the config's stores kept: see amx_configure, arch/amx/amx_bf16.h
  _tile_loadconfig(&c);
}

// acc[b][q][m][0..16) = the rows rx (RB row blocks of rows[b], as configured) times panels w[0..PB) over nsb
// superblocks. xq: the first row's values, xs bytes a row.
template <Format F, int RB, int PB>
__attribute__((target("amx-tile,amx-int8"))) inline void amx_k_pass(const QRow* rx, const int8_t* xq, int64_t xs,
                                                                     const uint8_t* const* w, int64_t nsb,
                                                                     const int* rows, float (*acc)[2][16][P]) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub, G = S.sub / 4;
  alignas(64) int32_t c[2][2][16][P];
  alignas(64) int8_t unpacked[2][QK / 4][64];
  for (int b = 0; b < RB; ++b)
    for (int q = 0; q < PB; ++q)
      for (int m = 0; m < rows[b]; ++m) _mm512_store_ps(acc[b][q][m], _mm512_setzero_ps());
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const KHeader<F> h[2] = {{w[0] + sb * ksb_bytes(S)}, {w[PB - 1] + sb * ksb_bytes(S)}};
    __m512 d[2], dmin[2];
    for (int q = 0; q < PB; ++q) {
      d[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h[q].d()));
      dmin[q] = S.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h[q].dmin())) : d[q];
    }
    for (int j = 0; j < S.sb / QK; ++j) {
      const int64_t b = sb * (S.sb / QK) + j;
      for (int q = 0; q < PB; ++q)
        for (int g = 0; g < QK / 4; ++g) _mm512_store_si512((void*)unpacked[q][g], kgroup512<F>(h[q].block(j), g));
      for (int s = 0; s < NS; ++s) {
        const int8_t* a = xq + b * QK + s * S.sub;
        _tile_zero(0);
        _tile_loadd(4, a, xs);
        _tile_loadd(6, unpacked[0][s * G], 64);
        TM_AMX_KDOT(F, 0, 4, 6);
        if constexpr (RB == 2) {
          _tile_zero(2);
          _tile_loadd(5, a + 16 * xs, xs);
          TM_AMX_KDOT(F, 2, 5, 6);
        }
        if constexpr (PB == 2) {
          _tile_zero(1);
          _tile_loadd(7, unpacked[1][s * G], 64);
          TM_AMX_KDOT(F, 1, 4, 7);
          if constexpr (RB == 2) {
            _tile_zero(3);
            TM_AMX_KDOT(F, 3, 5, 7);
          }
        }
        _tile_stored(0, c[0][0], 64);
        if constexpr (PB == 2) _tile_stored(1, c[0][1], 64);
        if constexpr (RB == 2) _tile_stored(2, c[1][0], 64);
        if constexpr (RB == 2 && PB == 2) _tile_stored(3, c[1][1], 64);
        for (int q = 0; q < PB; ++q) {
          __m512 scale, mins;
          kscales512<F>(h[q], j, s, d[q], dmin[q], scale, mins);
          for (int r = 0; r < RB; ++r)
            for (int m = 0; m < rows[r]; ++m) {
              const __m512i isum = _mm512_load_si512((const void*)c[r][q][m]);
              const __m512 sum = _mm512_load_ps(acc[r][q][m]);
              _mm512_store_ps(acc[r][q][m], kfinish512<F>(isum, rx[16 * r + m], b, s, scale, mins, sum));
            }
        }
      }
    }
  }
}

// Output panels [p_begin, p_end) of out[M, N] = x[M, K] @ w^T (+ bias) for a weight of the K family, x rows in the
// QRow layout `ldx` floats apart (as linear_kquant): 32 rows by 2 panels at a time; the K-quants a superblock at a
// time (arch/amx/amx_ksuper.h).
template <Format F>
__attribute__((target("amx-tile,amx-int8"))) void linear_amx_k(const float* x, int64_t M, int64_t ldx,
                                                                const uint8_t* packed, int64_t N, int64_t K,
                                                                const float* bias, float* out32, uint16_t* out16,
                                                                int64_t p_begin, int64_t p_end) {
  if constexpr (ksuper(F)) return linear_amx_ksuper<F>(x, M, ldx, packed, N, K, bias, out32, out16, p_begin, p_end);
  const int64_t nb = K / QK, nsb = K / kspec(F).sb, stride = panel_bytes(F, K), xs = ldx * 4;
  alignas(64) float acc[2][2][16][P];
  QRow rx[32];
  int configured[2] = {-1, -1};
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int rows[2] = {(int)std::min<int64_t>(16, M - m0), (int)std::clamp<int64_t>(M - m0 - 16, 0, 16)};
    if (rows[0] != configured[0] || rows[1] != configured[1])
      amx_configure_k<F>(rows[0], rows[1]), configured[0] = rows[0], configured[1] = rows[1];
    for (int r = 0; r < rows[0] + rows[1]; ++r) rx[r] = qrow(x + (m0 + r) * ldx, nb);
    for (int64_t p = p_begin; p < p_end; p += 2) {
      const uint8_t* w[2] = {packed + p * stride, packed + (p + 1) * stride};
      const int pb = p + 1 < p_end ? 2 : 1, rb = rows[1] ? 2 : 1;
      if (rb == 2 && pb == 2) amx_k_pass<F, 2, 2>(rx, rx[0].q, xs, w, nsb, rows, acc);
      else if (rb == 2) amx_k_pass<F, 2, 1>(rx, rx[0].q, xs, w, nsb, rows, acc);
      else if (pb == 2) amx_k_pass<F, 1, 2>(rx, rx[0].q, xs, w, nsb, rows, acc);
      else amx_k_pass<F, 1, 1>(rx, rx[0].q, xs, w, nsb, rows, acc);
      amx_store_pass(acc, rows, rb, pb, m0, p, N, bias, out32, out16);
    }
  }
  _tile_release();
}

}  // namespace tmk
