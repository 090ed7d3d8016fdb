// Prefill attention's two products on AMX (Sapphire Rapids and later), for a bf16 model (attention/prefill_amx.h):
// - scores: 32 query rows by two key panels at a time. A packed key panel ([Dh/2][16][2], attention/prefill.h's
//   pack_keys) is the B operand as stored, the rows' bf16 queries are A; bf16 x bf16 products are exact in float32,
//   so only the order of the sums differs from the vdpbf16ps tiles.
// - values: the probabilities (float32) as two bf16 parts, hi = p with its low 16 bits cut and lo = p - hi rounded
//   (p to ~2^-17 of itself, where one bf16 would keep 2^-9), each times the block's values paired by position
//   ([KB/2][Dh][2]), added to the rows' float32 outputs, which the tiles load and store in place.
//
// Every tile is 16 rows of 64 bytes: 16 x 16 float32 sums, 16 rows of 32 bf16 (A), or 16 pairs of 16 columns (B).
// Built into the avx512bf16 variant only, with per-function target flags (as amx_bf16.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>

#include "arch/amx/tiles.h"
#include "arch/isa.h"
#include "core/simd.h"

namespace tmk {

// tiles 0-3: sums; 4, 5: A; 6, 7: B
__attribute__((target("amx-tile"))) inline void amx_configure_attention() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  asm volatile("" : : "r"(&c) : "memory");  // the config's stores kept: see amx_configure, amx_bf16.h
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile"))) inline void amx_release_attention() { _tile_release(); }

// s[r][p * 16 + j] = (row r of q) . (key j of panel p), unscaled, for rows [0, rows) (a multiple of 32; q's bf16
// rows Dh apart) and panels [0, panels) (even; each Dh * 16 bf16), s rows lds floats apart; Dh a multiple of 32
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_attention_scores(const uint16_t* q, int64_t rows,
                                                                              int64_t Dh, const uint16_t* keys,
                                                                              int64_t panels, float* s, int64_t lds) {
  const int64_t qs = Dh * 2, ss = lds * 4, panel = Dh * 16;  // bytes between q rows, s rows; bf16 per panel
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    const uint16_t* q0 = q + r0 * Dh;
    for (int64_t p = 0; p < panels; p += 2) {
      const uint16_t* k0 = keys + p * panel;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j = 0; j < Dh / 32; ++j) {  // 16 pairs of k: 512 bf16 of a panel
        _tile_loadd(4, q0 + 32 * j, qs);
        _tile_loadd(5, q0 + 16 * Dh + 32 * j, qs);
        _tile_loadd(6, k0 + 512 * j, 64);
        _tile_loadd(7, k0 + panel + 512 * j, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* out = s + r0 * lds + p * 16;
      _tile_stored(0, out, ss);
      _tile_stored(1, out + 16, ss);
      _tile_stored(2, out + 16 * lds, ss);
      _tile_stored(3, out + 16 * lds + 16, ss);
    }
  }
}

// o[32 rows][c * 16 .. c * 16 + 32) += (hi + lo)[32 rows][0 .. 32 steps) . values: two row tiles by two column
// tiles, whose four sums start from o; each step's value tiles serve both parts (four column tiles of one row tile
// at a time, the hi and lo products of a tile back to back, ran as fast: scripts/prefill_attention_ab.py)
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_value_tiles(const uint16_t* hi, const uint16_t* lo,
                                                                         int64_t ldp, int64_t steps,
                                                                         const uint16_t* pairs, int64_t Dh, int64_t c,
                                                                         float* o) {
  const int64_t os = Dh * 4, ps = ldp * 2, vs = Dh * 4;  // bytes between o rows, p rows, value pairs
  float* o0 = o + c * 16;
  float* o1 = o0 + 16 * Dh;
  const uint16_t* v = pairs + c * 32;
  _tile_loadd(0, o0, os);
  _tile_loadd(1, o0 + 16, os);
  _tile_loadd(2, o1, os);
  _tile_loadd(3, o1 + 16, os);
  for (int64_t j = 0; j < steps; ++j) {  // 32 positions: 16 pairs
    const uint16_t* vj = v + 32 * j * Dh;
    _tile_loadd(6, vj, vs);
    _tile_loadd(7, vj + 32, vs);
    for (const uint16_t* part : {hi, lo}) {  // the same sums, hi's products then lo's
      _tile_loadd(4, part + 32 * j, ps);
      _tile_loadd(5, part + 16 * ldp + 32 * j, ps);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, o0, os);
  _tile_stored(1, o0 + 16, os);
  _tile_stored(2, o1, os);
  _tile_stored(3, o1 + 16, os);
}

// o[r][0..Dh) += p[r] . values for rows [0, rows) (a multiple of 32; o rows Dh apart), p as its hi and lo parts
// (rows ldp apart), over `steps` x 32 positions of the block's value pairs ([positions/2][Dh][2]); Dh % 32 == 0
inline void amx_attention_values(const uint16_t* hi, const uint16_t* lo, int64_t ldp, int64_t rows, int64_t steps,
                                 const uint16_t* pairs, int64_t Dh, float* o) {
  for (int64_t r0 = 0; r0 < rows; r0 += 32)
    for (int64_t c = 0; c < Dh / 16; c += 2)
      amx_value_tiles(hi + r0 * ldp, lo + r0 * ldp, ldp, steps, pairs, Dh, c, o + r0 * Dh);
}

// 32 probabilities as bf16 hi and lo parts: hi = p's top 16 bits, lo = p - hi rounded to nearest
inline void amx_split_bf16(__m512 a, __m512 b, uint16_t* hi, uint16_t* lo) {
  const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
  const __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
  const __m512 bh = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), top));
  _mm512_storeu_si512((void*)hi, (__m512i)_mm512_cvtne2ps_pbh(bh, ah));  // exact: ah, bh are bf16 already
  _mm512_storeu_si512((void*)lo, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah)));
}

// the lanes j .. j + 15 that lie in [lo, hi)
inline __mmask16 lanes_in(int64_t j, int64_t lo, int64_t hi) {
  const int64_t a = std::clamp<int64_t>(lo - j, 0, 16), b = std::clamp<int64_t>(hi - j, 0, 16);
  return (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
}

// 2^t for t <= 0: 2^n * 2^f with n = t rounded (vrndscaleps), f in [-0.5, 0.5] (exp2_fraction's ~1 ulp), scaled
// by vscalefps, which goes to 0 far below (e^x needs no clamp): 10 instructions, where exp_neg takes 15
inline __m512 amx_exp2(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps((__m512)exp2_fraction((vf)_mm512_sub_ps(t, n)), n);
}

// One row's block of `width` (a multiple of 32) unscaled scores, of which it sees [lo, hi), -> its probabilities
// against its running maximum mx (of scaled scores) and sum l, as bf16 hi and lo parts (zero outside [lo, hi)), in
// one pass: e^(s scale - max) as 2^(s scale log2 e - max log2 e), its argument in one FMA. Returns the factor the
// row's earlier sums must be scaled by.
inline float amx_softmax_row(const float* s, int64_t width, int64_t lo, int64_t hi, float scale, float& mx, float& l,
                             uint16_t* phi, uint16_t* plo) {
  if (hi <= lo) {
    std::memset(phi, 0, width * 2);
    std::memset(plo, 0, width * 2);
    return 1.f;
  }
  __m512 tops = _mm512_set1_ps(-INFINITY);
  for (int64_t j = lo & ~int64_t{15}; j < hi; j += 16)
    tops = _mm512_mask_max_ps(tops, lanes_in(j, lo, hi), tops, _mm512_loadu_ps(s + j));
  // scale > 0: the largest scaled score is the largest score scaled (rounding keeps the order)
  const float top = _mm512_reduce_max_ps(tops) * scale, m_new = std::max(mx, top);
  const float corr = mx == m_new ? 1.f : mx == -INFINITY ? 0.f : std::exp(mx - m_new);
  constexpr float LOG2E = 1.44269504088896341f;
  const __m512 k = _mm512_set1_ps(scale * LOG2E), shift = _mm512_set1_ps(-m_new * LOG2E);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 32) {
    __m512 e[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    if (j < hi && j + 32 > lo)
      for (int h = 0; h < 2; ++h) {
        const __mmask16 in = lanes_in(j + 16 * h, lo, hi);
        if (!in) continue;
        e[h] = _mm512_maskz_mov_ps(in, amx_exp2(_mm512_fmadd_ps(_mm512_loadu_ps(s + j + 16 * h), k, shift)));
        sums = _mm512_add_ps(sums, e[h]);
      }
    amx_split_bf16(e[0], e[1], phi + j, plo + j);
  }
  l = l * corr + _mm512_reduce_add_ps(sums), mx = m_new;
  return corr;
}

// The value rows of n positions (bf16 row pointers) as pairs of positions, [ceil(n / 32) * 16][Dh][2], zero past n:
// pair i holds positions 2i and 2i + 1 side by side at each column (the B operand of the values' product)
inline void amx_pair_values(const uint16_t* const* rows, int64_t n, int64_t Dh, uint16_t* pairs) {
  const int64_t count = (n + 31) / 32 * 16;
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t* a = 2 * i < n ? rows[2 * i] : nullptr;
    const uint16_t* b = 2 * i + 1 < n ? rows[2 * i + 1] : nullptr;
    for (int64_t d = 0; d < Dh; d += 16) {
      const __m512i x = a ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + d))) : _mm512_setzero_si512();
      const __m512i y = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + d))) : _mm512_setzero_si512();
      _mm512_storeu_si512((void*)(pairs + (i * Dh + d) * 2), _mm512_or_si512(x, _mm512_slli_epi32(y, 16)));
    }
  }
}

}  // namespace tmk
