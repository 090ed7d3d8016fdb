// Decode attention over a bf16 or quantized cache with AVX-512 BF16 (attention/decode.h says how), and prefill's key
// panels transposed in registers. attention/decode.h picks this file.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "arch/isa.h"
#include "attention/common.h"
#include "attention/kv_quant.h"
#include "core/simd.h"

#if !TM_BF16_PAIRS
#error "arch/avx512bf16/attention.h is for 16-lane builds with AVX-512 BF16 (the avx512bf16 variant)"
#endif

namespace tmk {


// r[i][j] <- r[j][i] for 16 rows of 16 32-bit lanes: pairs of rows interleaved, then pairs of pairs, then 128-bit
// lanes gathered (unpack, unpack, shuffle, shuffle)
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c]: lane L holds column 4L + c of rows i..i+3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);  // column c
    t[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 32 of a row's values from p as 16 bf16 pairs: a bf16 row's as they lie; a quantized row's codes without their
// scale (which multiplies the row's scores or weights instead), exact in bf16: an int8 or an e4m3 has at most 8
// significant bits
template <typename E>
inline __m512i pairs32(const E* p) {
  if constexpr (std::is_same_v<E, uint16_t>) return _mm512_loadu_si512((const void*)p);
  else return (__m512i)_mm512_cvtne2ps_pbh((__m512)load_codes(p + 16), (__m512)load_codes(p));
}

// 16 of a row's values from p as float32 (a quantized row's codes, as above)
template <typename E>
inline __m512 floats16(const E* p) {
  if constexpr (std::is_same_v<E, uint16_t>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  else return (__m512)load_codes(p);
}

// scores[j][0..m) = scale * q_j . key_i for GC heads (q rows Dh apart, bf16) and m <= 16 keys (rows of E); a
// quantized key's dot products times its scale (kscale [m]) first: exact, a power of two (attention/kv_quant.h), so
// the bits are those of its codes times the scale in bf16, which every other path reads
template <int GC, typename E>
inline void key_scores(const uint16_t* q, const E* const* keys, int m, int64_t Dh, float scale, const float* kscale,
                       float* scores, int64_t ld) {
  __m512 acc[GC];
  for (int j = 0; j < GC; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < Dh; c += 32) {  // 32 values = 16 bf16 pairs: one zmm per key
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < m ? pairs32(keys[i] + c) : _mm512_setzero_si512();
    transpose16(r);  // r[p]: pair p of the 16 keys
    for (int p = 0; p < 16; ++p)
      for (int j = 0; j < GC; ++j) {
        uint32_t pair;
        std::memcpy(&pair, q + j * Dh + c + 2 * p, 4);
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)r[p], (__m512bh)_mm512_set1_epi32((int)pair));
      }
  }
  const __mmask16 valid = (__mmask16)((1u << m) - 1);
  const __m512 ks = kscale ? _mm512_maskz_loadu_ps(valid, kscale) : _mm512_set1_ps(1.f);
  for (int j = 0; j < GC; ++j)
    _mm512_mask_storeu_ps(scores + j * ld, valid, _mm512_mul_ps(_mm512_mul_ps(acc[j], ks), _mm512_set1_ps(scale)));
}

// acc[j][0..NV 16) += sum over i < n of p[j][i] * value_i[0..NV 16) for GC heads, the values rows of E: each
// value widened once for every head, the sums in registers
template <int GC, int NV, typename E>
inline void value_sums(const E* const* values, int64_t n, const float* p, int64_t ld, float* acc, int64_t Dh) {
  __m512 a[GC][NV];
  for (int j = 0; j < GC; ++j)
    for (int v = 0; v < NV; ++v) a[j][v] = _mm512_loadu_ps(acc + j * Dh + 16 * v);
  for (int64_t i = 0; i < n; ++i) {
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = floats16(values[i] + 16 * v);
    for (int j = 0; j < GC; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * ld + i]);
      for (int v = 0; v < NV; ++v) a[j][v] = _mm512_fmadd_ps(w, x[v], a[j][v]);
    }
  }
  for (int j = 0; j < GC; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + j * Dh + 16 * v, a[j][v]);
}

// The AVX-512 BF16 path of attention_split (Dh % 32 == 0): keys at cache + row[t], values `vshift` elements
// further, for a split's n positions -> acc [G, Dh] and ml [G, 2]; scores: scratch [G, n]. A quantized cache
// (E = int8_t or f8e4m3) is read where it lies, its rows' scales in rs [2, n] (keys', then values'): each key's
// multiplies its scores, each value's its weights.
template <typename E>
inline void attention_bf16(const uint16_t* qh, const E* cache, const int64_t* row, int64_t vshift, int64_t n, int64_t G,
                           int64_t Dh, float scale, float* acc, float* ml, float* scores, const float* rs) {
  const E* rows[16];
  RowAsker ask{[&](int64_t i) { return cache + (i < n ? row[i] : row[i - n] + vshift); }, 2 * n,
               Dh * (int64_t)sizeof(E)};
  for (int64_t t = 0; t < n; t += 16) {
    ask.until(t + 16);  // these 16 keys and kAskAhead more
    const int m = (int)std::min<int64_t>(16, n - t);
    for (int i = 0; i < m; ++i) rows[i] = cache + row[t + i];
    for (int64_t j = 0; j < G; j += 8)  // heads 8 at a time (8 sums + 16 keys in registers)
      with_rows<8>(std::min<int64_t>(8, G - j), [&](auto gc) {
        key_scores<decltype(gc)::value>(qh + j * Dh, rows, m, Dh, scale, rs ? rs + t : nullptr, scores + j * n + t,
                                        n);
      });
  }
  ask.until(n);  // the first values, while the softmax runs
  softmax_rows(scores, G, n, ml);
  if (rs)  // each value's scale into its weights (exact: a power of two)
    for (int64_t j = 0; j < G; ++j)
      for (int64_t i = 0; i < n; ++i) scores[j * n + i] *= rs[n + i];
  std::fill(acc, acc + G * Dh, 0.f);
  for (int64_t t = 0; t < n; t += 16) {
    ask.until(n + t + 16);
    const int64_t m = std::min<int64_t>(16, n - t);
    for (int64_t j = 0; j < G; j += 7)  // heads 7 at a time: 7 x 4 sums in registers
      with_rows<7>(std::min<int64_t>(7, G - j), [&](auto gc) {
        constexpr int GC = decltype(gc)::value;
        const float* p = scores + j * n + t;
        for (int64_t d = 0; d < Dh;) {
          for (int64_t i = 0; i < m; ++i) rows[i] = cache + row[t + i] + vshift + d;
          if (d + 64 <= Dh) value_sums<GC, 4>(rows, m, p, n, acc + j * Dh + d, Dh), d += 64;
          else value_sums<GC, 1>(rows, m, p, n, acc + j * Dh + d, Dh), d += 16;
        }
      });
  }
}

// attention_split's path for a bf16 or quantized cache (Dh a multiple of 32; false, and nothing done, otherwise):
// the split's positions [t0, t1) of sequence b's KV head g, their rows' offsets in scratch past the scores; a
// quantized cache's scales [2, slots, Hkv] in kv_scales
template <typename E>
inline bool attention_split_bf16(const uint16_t* q, const E* cache, int64_t slots, const int64_t* table, int64_t t0,
                                 int64_t t1, int64_t b, int64_t g, int64_t H, int64_t G, int64_t Dh, int64_t kv_stride,
                                 int64_t block_size, float scale, float* acc, float* ml, float* scratch,
                                 const uint16_t* kv_scales = nullptr) {
  if (Dh % 32 != 0) return false;
  const int64_t n = t1 - t0, Hkv = kv_stride / Dh;
  thread_local std::vector<float> rs;  // [2, n]: the keys' and values' scales
  if (kv_scales) rs.resize(2 * n);
  // the slot of position t is table[t / block_size] * block_size + t % block_size
  int64_t* row = (int64_t*)(scratch + ((G * kSplit + 1) & ~int64_t{1}));  // [n]: keys' offsets
  for (int64_t t = t0, i = 0, block = t0 / block_size, off = t0 % block_size; t < t1; ++t, ++i) {
    const int64_t slot = table[block] * block_size + off;
    row[i] = slot * kv_stride + g * Dh;
    if (kv_scales) {
      rs[i] = bf16_to_float(kv_scales[slot * Hkv + g]);
      rs[n + i] = bf16_to_float(kv_scales[(slots + slot) * Hkv + g]);
    }
    if (++off == block_size) off = 0, ++block;
  }
  attention_bf16(q + (b * H + g * G) * Dh, cache, row, slots * kv_stride, n, G, Dh, scale, acc, ml, scratch,
                 kv_scales ? rs.data() : nullptr);
  return true;
}

// prefill's pack_keys for a bf16 cache (Dh a multiple of 32; false, and nothing done, otherwise): m <= 16 keys
// (row pointers) -> dst [Dh/2][P] words, each panel row one pair of the 16 keys, transposed in registers
inline bool pack_keys_bf16(const uint16_t* const* key, int64_t m, int64_t Dh, uint32_t* dst) {
  if (Dh % 32 != 0) return false;
  for (int64_t c = 0; c < Dh; c += 32) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < m ? _mm512_loadu_si512((const void*)(key[i] + c)) : _mm512_setzero_si512();
    transpose16(r);  // r[j]: pair j of the 16 keys
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512((void*)(dst + (c / 2 + j) * P), r[j]);
  }
  return true;
}

}  // namespace tmk
