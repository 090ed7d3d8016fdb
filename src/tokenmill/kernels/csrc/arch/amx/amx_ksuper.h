// The K-quants (Q4_K, Q5_K, Q6_K) on AMX-INT8, a superblock (256 k) per product. Their rows carry one scale per
// superblock (linear/qrow.h), so a superblock's sum is one integer per (row, channel) before its float scales:
//   T = sum over k of qx * sc(sub-block) * (q - zero),   Mn = sum over k of qx * mn(sub-block)
// and acc += dx * (d * T - dmin * Mn), the other tiles' arithmetic (arch/avx512bf16/ktile512.h). sc * (q - zero)
// does not fit a byte, so each superblock is unpacked once per panel into three byte planes whose products add up
// to T and Mn, with the tile's full 64 k per instruction:
//   Q4_K: sc = 16 a + b (a 0..3, b 0..15): planes a q and b q (at most 225, unsigned), and mn; T = 16 C0 + C1
//   Q5_K: sc = 8 a + b (0..7 each): planes a q and b q (at most 217), and mn; T = 8 C0 + C1
//   Q6_K: sc = 64 a + 8 b + c (digits -3..4): planes a (q - 32), b (q - 32), c (q - 32) (signed, -128..124);
//         T = 64 C0 + 8 C1 + C2
// The integer sums are exact, so a row's outputs are the same bits as on the VNNI tiles, whatever the batch.
//
// Loops: blocks of rows that stay in L2; for each, a pair of panels at a time; for each superblock its planes
// (3 x 2 x 4 KB) are built once and every 16 of the rows multiply them: tiles 0-2 panel 0's planes, 3-5 panel 1's,
// 6 the rows' 64 k, 7 a plane's 64 k. The planes ask for the weights a superblock or two ahead (into L2, a line a
// group): without it the tiles' bursts left the memory idle and 16 rows from DRAM ran slower than the old tiles.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "arch/amx/amx_int8.h"
#include "arch/amx/tiles.h"
#include "arch/avx512bf16/ktile512.h"
#include "core/cpu.h"
#include "linear/common.h"
#include "linear/format.h"
#include "linear/kformat.h"
#include "linear/qrow.h"

namespace tmk {

constexpr bool kplanes_signed(Format F) { return F == Q6_K; }
#ifndef KSUPER_AHEAD
#define KSUPER_AHEAD 2
#endif

// Sub-block `sub`'s scales as the planes' digits, int32 lanes with the digit in both 16-bit halves (vpmullw's)
template <Format F>
inline void kdigits(const KHeader<F>& h, int sub, __m512i* dig) {
  const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)h.sc(sub)));
  __m512i d32[3];
  if constexpr (F == Q6_K) {  // balanced base 8: each digit ((v + 3) mod 8) - 3
    const __m512i three = _mm512_set1_epi32(3), seven = _mm512_set1_epi32(7);
    __m512i v = sc;
    for (int i = 2; i >= 0; --i) {
      d32[i] = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, three), seven), three);
      v = _mm512_srai_epi32(_mm512_sub_epi32(v, d32[i]), 3);
    }
  } else {
    constexpr int bits = F == Q4_K ? 4 : 3;
    d32[0] = _mm512_srli_epi32(sc, bits);
    d32[1] = _mm512_and_si512(sc, _mm512_set1_epi32((1 << bits) - 1));
    d32[2] = _mm512_setzero_si512();
  }
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  for (int i = 0; i < 3; ++i) dig[i] = _mm512_or_si512(_mm512_and_si512(d32[i], low16), _mm512_slli_epi32(d32[i], 16));
}

// bytes v times a digit per 32-bit lane (both 16-bit halves), as bytes: exact where each product fits a byte
template <bool Signed>
inline __m512i kmul_bytes(__m512i v, __m512i dig) {
  const __m512i low = _mm512_mullo_epi16(v, dig);  // each word's low byte right (carries only go up)
  if constexpr (!Signed) return low;               // unsigned products under 256 carry nothing
  const __m512i high = _mm512_mullo_epi16(_mm512_and_si512(v, _mm512_set1_epi16((short)0xFF00)), dig);
  return _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi16(0x00FF), 0xE4);  // low where the mask, else high
}

// One panel's superblock -> its planes: out[plane][chunk of 64 k][16 groups of 4 k][16 channels x 4 k]
template <Format F>
inline void kbuild_planes(const KHeader<F>& h, int8_t (*out)[4][16][64], const uint8_t* ahead) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub, G = S.sub / 4;
  int64_t line = 0;  // of the superblock `ahead` (or none): one line asked for into L2 per group built
  for (int j = 0; j < S.sb / QK; ++j)
    for (int s = 0; s < NS; ++s) {
      __m512i dig[3];
      kdigits<F>(h, j * NS + s, dig);
      __m512i mins = _mm512_setzero_si512();
      if constexpr (S.has_min)  // each channel's mn in its 4 bytes
        mins = _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)h.mn(j * NS + s))),
                                  _mm512_set1_epi32(0x01010101));
      for (int gg = 0; gg < G; ++gg) {
        const int g = s * G + gg, row = (j % 2) * 8 + g;
        if (ahead && line < ksb_bytes(S)) prefetch_l2(ahead + line), line += 64;
        int8_t* const dst[3] = {out[0][j / 2][row], out[1][j / 2][row], out[2][j / 2][row]};
        __m512i v = kgroup512<F>(h.block(j), g);
        if constexpr (kplanes_signed(F)) {
          v = _mm512_sub_epi8(v, _mm512_set1_epi8((char)S.zero));
          for (int i = 0; i < 3; ++i) _mm512_store_si512((void*)dst[i], kmul_bytes<true>(v, dig[i]));
        } else {
          _mm512_store_si512((void*)dst[0], kmul_bytes<false>(v, dig[0]));
          _mm512_store_si512((void*)dst[1], kmul_bytes<false>(v, dig[1]));
          _mm512_store_si512((void*)dst[2], mins);
        }
      }
    }
}

__attribute__((target("amx-tile,amx-int8"))) inline void amx_configure_ksuper(int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = (uint8_t)(t == 7 ? 16 : rows), c.colsb[t] = 64;
  asm volatile("" : : "r"(&c) : "memory");  // the config's stores kept: see amx_configure, arch/amx/amx_bf16.h
  _tile_loadconfig(&c);
}

// tile c += tile 6 (the rows' bytes) x tile 7 (a plane): signed planes TDPBSSD, unsigned TDPBSUD
#define TM_AMX_PLANE(F, c, plane)                    \
  do {                                               \
    _tile_loadd(7, plane, 64);                       \
    if constexpr (kplanes_signed(F)) _tile_dpbssd(c, 6, 7); \
    else _tile_dpbsud(c, 6, 7);                      \
  } while (0)

// `rows` rows (QRow rx, their bytes from xq, xs apart) times the PB panels' planes of superblock sb -> c[panel][plane]
template <Format F, int PB>
__attribute__((target("amx-tile,amx-int8"))) inline void amx_ksuper_rows(const int8_t* xq, int64_t xs,
                                                                          int8_t (*planes)[3][4][16][64],
                                                                          int32_t (*c)[3][16][P]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (PB == 2) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
  }
  for (int ch = 0; ch < 4; ++ch) {
    _tile_loadd(6, xq + 64 * ch, xs);
    TM_AMX_PLANE(F, 0, planes[0][0][ch]);
    TM_AMX_PLANE(F, 1, planes[0][1][ch]);
    TM_AMX_PLANE(F, 2, planes[0][2][ch]);
    if constexpr (PB == 2) {
      TM_AMX_PLANE(F, 3, planes[1][0][ch]);
      TM_AMX_PLANE(F, 4, planes[1][1][ch]);
      TM_AMX_PLANE(F, 5, planes[1][2][ch]);
    }
  }
  _tile_stored(0, c[0][0], 64);
  _tile_stored(1, c[0][1], 64);
  _tile_stored(2, c[0][2], 64);
  if constexpr (PB == 2) {
    _tile_stored(3, c[1][0], 64);
    _tile_stored(4, c[1][1], 64);
    _tile_stored(5, c[1][2], 64);
  }
}

// a row's T and F (its mins' sum, Mn) from its three plane sums (16 channels)
template <Format F>
inline void kplanes_sums(const int32_t (*c)[16][P], int r, __m512i& T, __m512& Mn) {
  const __m512i c0 = _mm512_load_si512((const void*)c[0][r]), c1 = _mm512_load_si512((const void*)c[1][r]);
  const __m512i c2 = _mm512_load_si512((const void*)c[2][r]);
  if constexpr (F == Q6_K) {
    T = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(c0, 3), c1), 3), c2);
    Mn = _mm512_setzero_ps();
  } else {
    T = _mm512_add_epi32(_mm512_slli_epi32(c0, F == Q4_K ? 4 : 3), c1);
    Mn = _mm512_cvtepi32_ps(c2);
  }
}

// Rows [m0, m0 + mc) of x (QRow, ldx floats apart; their values from xq, xs bytes apart) by the pb panels from p:
// each superblock's planes built once, then multiplied by every 16 of the rows (the last ones copied, padded with
// zero rows, so the tiles keep one shape); their float sums into acc[mc][2][P]
template <Format F>
__attribute__((target("amx-tile,amx-int8"))) inline void amx_ksuper_block(const float* x, int64_t ldx, const int8_t* xq,
                                                                          int64_t xs, int64_t m0, int64_t mc,
                                                                          const uint8_t* const* w, int pb, int64_t nsb,
                                                                          float (*acc)[2][P]) {
  constexpr KSpec S = kspec(F);
  alignas(64) static thread_local int8_t planes[2][3][4][16][64];
  alignas(64) static thread_local int8_t tail[16][S.sb];
  alignas(64) int32_t c[2][3][16][P];
  for (int64_t m = 0; m < mc; ++m) std::fill(acc[m][0], acc[m][0] + 2 * P, 0.f);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m512 d[2], dmin[2];
    for (int q = 0; q < pb; ++q) {
      const KHeader<F> h{w[q] + sb * ksb_bytes(S)};
      kbuild_planes<F>(h, planes[q], sb + KSUPER_AHEAD < nsb ? h.at + KSUPER_AHEAD * ksb_bytes(S) : nullptr);
      d[q] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h.d()));
      dmin[q] = S.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h.dmin())) : d[q];
    }
    for (int64_t r0 = 0; r0 < mc; r0 += 16) {
      const int rows = (int)std::min<int64_t>(16, mc - r0);
      const int8_t* a = xq + (m0 + r0) * xs + sb * S.sb;
      int64_t as = xs;
      if (rows < 16) {
        for (int r = 0; r < 16; ++r)
          if (r < rows) std::memcpy(tail[r], a + r * xs, S.sb);
          else std::memset(tail[r], 0, S.sb);
        a = tail[0], as = S.sb;
      }
      if (pb == 2) amx_ksuper_rows<F, 2>(a, as, planes, c);
      else amx_ksuper_rows<F, 1>(a, as, planes, c);
      for (int q = 0; q < pb; ++q)
        for (int r = 0; r < rows; ++r) {
          __m512i T;
          __m512 Fl;
          kplanes_sums<F>(c[q], r, T, Fl);
          const float dx = x[(m0 + r0 + r) * ldx + sb * (S.sb / QK)];  // the row's scale (QRow::d) here
          float* sums = acc[r0 + r][q];
          _mm512_storeu_ps(sums, kfinish_super512<F>(T, Fl, dx, d[q], dmin[q], _mm512_loadu_ps(sums)));
        }
    }
  }
}

// Output panels [p_begin, p_end) of out[M, N] = x[M, K] @ w^T (+ bias) for a K-quant weight, x rows in the QRow
// layout `ldx` floats apart quantized per superblock (row_group): blocks of rows whose bytes (~1 MB) stay in L2, and
// for each, the panels two at a time
template <Format F>
__attribute__((target("amx-tile,amx-int8"))) void linear_amx_ksuper(const float* x, int64_t M, int64_t ldx,
                                                                     const uint8_t* packed, int64_t N, int64_t K,
                                                                     const float* bias, float* out32,
                                                                     uint16_t* out16, int64_t p_begin, int64_t p_end) {
  const int64_t nsb = K / kspec(F).sb, stride = panel_bytes(F, K), xs = ldx * 4;
  const int64_t MB = std::clamp<int64_t>((1 << 20) / K / 16 * 16, 32, 256);
  alignas(64) float acc[256][2][P];
  const int8_t* xq = qrow(x, K / QK).q;
  amx_configure_ksuper(16);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mc = std::min(MB, M - m0);
    for (int64_t p = p_begin; p < p_end; p += 2) {
      const int pb = p + 1 < p_end ? 2 : 1;
      const uint8_t* w[2] = {packed + p * stride, packed + (p + pb - 1) * stride};
      amx_ksuper_block<F>(x, ldx, xq, xs, m0, mc, w, pb, nsb, acc);
      for (int q = 0; q < pb; ++q) {
        const int64_t n0 = (p + q) * P, n_valid = std::min<int64_t>(P, N - n0);
        for (int64_t m = 0; m < mc; ++m) store_outputs(acc[m][q], m0 + m, n0, n_valid, N, bias, out32, out16);
      }
    }
  }
  _tile_release();
}

}  // namespace tmk
