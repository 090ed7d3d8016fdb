// Decode attention over a bf16 cache with AVX-512 BF16 (attention/decode.h says how), and prefill's key panels
// transposed in registers. attention/decode.h picks this file.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "arch/isa.h"
#include "attention/common.h"
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

// scores[j][0..m) = scale * q_j . key_i for GC heads (q rows Dh apart, bf16) and m <= 16 keys (bf16 rows)
template <int GC>
inline void key_scores(const uint16_t* q, const uint16_t* const* keys, int m, int64_t Dh, float scale, float* scores,
                       int64_t ld) {
  __m512 acc[GC];
  for (int j = 0; j < GC; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < Dh; c += 32) {  // 32 values = 16 bf16 pairs: one zmm per key
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < m ? _mm512_loadu_si512((const void*)(keys[i] + c)) : _mm512_setzero_si512();
    transpose16(r);  // r[p]: pair p of the 16 keys
    for (int p = 0; p < 16; ++p)
      for (int j = 0; j < GC; ++j) {
        uint32_t pair;
        std::memcpy(&pair, q + j * Dh + c + 2 * p, 4);
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)r[p], (__m512bh)_mm512_set1_epi32((int)pair));
      }
  }
  const __mmask16 valid = (__mmask16)((1u << m) - 1);
  for (int j = 0; j < GC; ++j) _mm512_mask_storeu_ps(scores + j * ld, valid, _mm512_mul_ps(acc[j], _mm512_set1_ps(scale)));
}

// acc[j][0..NV 16) += sum over i < n of p[j][i] * value_i[0..NV 16) for GC heads, the values bf16 rows: each
// value widened once for every head, the sums in registers
template <int GC, int NV>
inline void value_sums(const uint16_t* const* values, int64_t n, const float* p, int64_t ld, float* acc,
                       int64_t Dh) {
  __m512 a[GC][NV];
  for (int j = 0; j < GC; ++j)
    for (int v = 0; v < NV; ++v) a[j][v] = _mm512_loadu_ps(acc + j * Dh + 16 * v);
  for (int64_t i = 0; i < n; ++i) {
    __m512 x[NV];
    for (int v = 0; v < NV; ++v)
      x[v] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(values[i] + 16 * v))), 16));
    for (int j = 0; j < GC; ++j) {
      const __m512 w = _mm512_set1_ps(p[j * ld + i]);
      for (int v = 0; v < NV; ++v) a[j][v] = _mm512_fmadd_ps(w, x[v], a[j][v]);
    }
  }
  for (int j = 0; j < GC; ++j)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + j * Dh + 16 * v, a[j][v]);
}

// The AVX-512 BF16 path of attention_split (Dh % 32 == 0): keys at cache + row[t], values `vshift` elements
// further, for a split's n positions -> acc [G, Dh] and ml [G, 2]; scores: scratch [G, n]
inline void attention_bf16(const uint16_t* qh, const uint16_t* cache, const int64_t* row, int64_t vshift,
                           int64_t n, int64_t G, int64_t Dh, float scale, float* acc, float* ml, float* scores) {
  const uint16_t* rows[16];
  RowAsker ask{[&](int64_t i) { return cache + (i < n ? row[i] : row[i - n] + vshift); }, 2 * n, Dh * 2};
  for (int64_t t = 0; t < n; t += 16) {
    ask.until(t + 16);  // these 16 keys and kAskAhead more
    const int m = (int)std::min<int64_t>(16, n - t);
    for (int i = 0; i < m; ++i) rows[i] = cache + row[t + i];
    for (int64_t j = 0; j < G; j += 8)  // heads 8 at a time (8 sums + 16 keys in registers)
      with_rows<8>(std::min<int64_t>(8, G - j), [&](auto gc) {
        key_scores<decltype(gc)::value>(qh + j * Dh, rows, m, Dh, scale, scores + j * n + t, n);
      });
  }
  ask.until(n);  // the first values, while the softmax runs
  softmax_rows(scores, G, n, ml);
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

// attention_split's path for a bf16 cache (Dh a multiple of 32; false, and nothing done, otherwise): the split's
// positions [t0, t1) of sequence b's KV head g, their keys' offsets in scratch past the scores
inline bool attention_split_bf16(const uint16_t* q, const uint16_t* cache, int64_t slots, const int64_t* table,
                                 int64_t t0, int64_t t1, int64_t b, int64_t g, int64_t H, int64_t G, int64_t Dh,
                                 int64_t kv_stride, int64_t block_size, float scale, float* acc, float* ml,
                                 float* scratch) {
  if (Dh % 32 != 0) return false;
  const int64_t n = t1 - t0;
  // the slot of position t is table[t / block_size] * block_size + t % block_size
  int64_t* row = (int64_t*)(scratch + ((G * kSplit + 1) & ~int64_t{1}));  // [n]: keys' offsets
  for (int64_t t = t0, i = 0, block = t0 / block_size, off = t0 % block_size; t < t1; ++t, ++i) {
    row[i] = (table[block] * block_size + off) * kv_stride + g * Dh;
    if (++off == block_size) off = 0, ++block;
  }
  attention_bf16(q + (b * H + g * G) * Dh, cache, row, slots * kv_stride, n, G, Dh, scale, acc, ml, scratch);
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
