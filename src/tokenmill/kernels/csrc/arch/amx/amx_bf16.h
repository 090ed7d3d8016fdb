// bf16 weights on AMX (Sapphire Rapids and later): one TDPBF16PS multiplies up to 16 rows of x by 16 k pairs of a
// panel, into 16 x 16 float32 sums held in a tile register. A bf16 panel's k-pair layout ([K/2][16][2], formats.py)
// is the B operand as stored: 16 pairs are 16 rows of 64 bytes, back to back. x's bf16 rows are A, 32 k of each
// row, read in place with the rows' own stride. The products are exact in float32, so only the order of the sums
// differs from the vdpbf16ps pair tiles (arch/avx512bf16/pair_tile.h), as it already does between their one-row and many-row tiles.
//
// Built into the avx512bf16 variant only, with per-function target flags: the same variant runs on a Zen 4 without
// AMX, where amx_native() (arch/amx/tiles.h) is false and nothing here runs. linear/amx.h picks this file.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "arch/amx/tiles.h"
#include "arch/isa.h"
#include "core/vec.h"
#include "linear/common.h"

namespace tmk {

// Two row blocks (r0 and r1 rows; r1 0: one) by two panels. Tiles 0, 1: sums of row block 0 by panels 0, 1 (r0 x
// 16 floats); 2, 3: row block 1's; 4, 5: A, 32 bf16 of each row of blocks 0, 1; 6, 7: B, 16 pairs of panels 0, 1.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure(int r0, int r1) {
  TileConfig c;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) c.rows[t] = (uint8_t)rows[t], c.colsb[t] = rows[t] ? 64 : 0;
  // GCC 12 may drop stores to a config it sees no read of: a test build setting the fields one by one loaded a
  // config of zero rows, and the first tile instruction faulted (SIGILL)
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// c[b][q][m][0..16) = the first 32 * full k of row m of row block b of x (bf16, row stride ldx elements) by
// panel q (w[q]), for RB row blocks and PB panels, as configured by amx_configure.
template <int RB, int PB>
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_tile(const uint16_t* x, int64_t ldx,
                                                                   const uint16_t* const* w, int64_t full,
                                                                   float (*c)[2][16][P]) {
  constexpr int64_t step = 16 * 2 * P;  // bf16 values in 16 pairs of a panel
  const int64_t xs = ldx * 2, x1 = 16 * ldx;  // bytes between rows; elements to row block 1
  _tile_zero(0);
  if constexpr (PB == 2) _tile_zero(1);
  if constexpr (RB == 2) _tile_zero(2);
  if constexpr (RB == 2 && PB == 2) _tile_zero(3);
  for (int64_t j = 0; j < full; ++j) {
    _tile_loadd(4, x + 32 * j, xs);
    _tile_loadd(6, w[0] + j * step, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (RB == 2) {
      _tile_loadd(5, x + x1 + 32 * j, xs);
      _tile_dpbf16ps(2, 5, 6);
    }
    if constexpr (PB == 2) {
      _tile_loadd(7, w[1] + j * step, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (RB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0][0], 64);
  if constexpr (PB == 2) _tile_stored(1, c[0][1], 64);
  if constexpr (RB == 2) _tile_stored(2, c[1][0], 64);
  if constexpr (RB == 2 && PB == 2) _tile_stored(3, c[1][1], 64);
}

// The last `tail` k pairs (K % 32 / 2) of `rows` rows of x (from the tail's first k) by one panel's tail pairs,
// added to c[m][0..16) with vdpbf16ps (the same products).
inline void amx_tail(const uint16_t* x, int64_t ldx, const uint16_t* w, int tail, int rows, float (*c)[P]) {
  for (int m = 0; m < rows; ++m) {
    __m512 acc = _mm512_loadu_ps(c[m]);
    for (int t = 0; t < tail; ++t) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * t, 4);
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void*)(w + t * 2 * P)),
                             (__m512bh)_mm512_set1_epi32(pair));
    }
    _mm512_storeu_ps(c[m], acc);
  }
}

template <int RB, int PB>
inline void amx_block(const uint16_t* x, int64_t ldx, const uint16_t* const* w, int64_t full, int tail,
                      const int* rows, float (*c)[2][16][P]) {
  amx_tile<RB, PB>(x, ldx, w, full, c);
  if (tail)
    for (int b = 0; b < RB; ++b)
      for (int q = 0; q < PB; ++q)
        amx_tail(x + b * 16 * ldx + 32 * full, ldx, w[q] + full * 16 * 2 * P, tail, rows[b], c[b][q]);
}

// Output panels [p_begin, p_end) of out[M, N] = x[M, K] @ w^T (+ bias) for a bf16 weight, x the model's bf16 rows
// (row stride ldx; K even, the rows' own width): 32 rows by 2 panels at a time, each row block's x and the
// chunk's panels reused from cache across the other's.
__attribute__((target("amx-tile,amx-bf16"))) inline void linear_amx(const uint16_t* x, int64_t M, int64_t ldx,
                                                                     const uint8_t* packed, int64_t N, int64_t K,
                                                                     const float* bias, float* out32, uint16_t* out16,
                                                                     int64_t p_begin, int64_t p_end) {
  const int64_t pairs = K / 2, full = pairs / 16, stride = K * P;  // stride: bf16 values per panel
  const int tail = (int)(pairs % 16);
  alignas(64) float c[2][2][16][P];
  int configured[2] = {-1, -1};
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int rows[2] = {(int)std::min<int64_t>(16, M - m0), (int)std::clamp<int64_t>(M - m0 - 16, 0, 16)};
    if (rows[0] != configured[0] || rows[1] != configured[1])
      amx_configure(rows[0], rows[1]), configured[0] = rows[0], configured[1] = rows[1];
    const uint16_t* xr = x + m0 * ldx;
    for (int64_t p = p_begin; p < p_end; p += 2) {
      const uint16_t* w[2] = {(const uint16_t*)packed + p * stride, (const uint16_t*)packed + (p + 1) * stride};
      const int pb = p + 1 < p_end ? 2 : 1, rb = rows[1] ? 2 : 1;
      if (rb == 2 && pb == 2) amx_block<2, 2>(xr, ldx, w, full, tail, rows, c);
      else if (rb == 2) amx_block<2, 1>(xr, ldx, w, full, tail, rows, c);
      else if (pb == 2) amx_block<1, 2>(xr, ldx, w, full, tail, rows, c);
      else amx_block<1, 1>(xr, ldx, w, full, tail, rows, c);
      for (int b = 0; b < rb; ++b)
        for (int q = 0; q < pb; ++q) {
          const int64_t n0 = (p + q) * P, n_valid = std::min<int64_t>(P, N - n0);
          for (int m = 0; m < rows[b]; ++m)
            store_outputs(c[b][q][m], m0 + 16 * b + m, n0, n_valid, N, bias, out32, out16);
        }
    }
  }
  _tile_release();
}
}  // namespace tmk
