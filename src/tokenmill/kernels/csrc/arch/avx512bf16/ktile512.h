// The K family's tiles with AVX-512 VNNI: one zmm register holds a group's 16 channels x 4 k (the nibble bytes'
// low halves for channels 0-7, their high halves for 8-15), and each bit plane's 64-bit mask adds 16 << p to exactly
// the bytes it covers (a masked byte add, AVX-512 BW); IQ4's nibbles become their unsigned table values (vpshufb).
// One vpdpbusd per row and group does 64 products.
//
// The integer sums and their scaling are arch/avx2/ktile.h's (linear/kformat.h), lane for lane. Tiles of up to 8
// rows; 1-3 rows on a Zen 4 take the ymm tiles, as the Q8_0/Q4_0 tiles do (core/cpu.h).
// linear/kquant.h picks this file where the build has AVX-512 VNNI (the avx512bf16 variant).
#pragma once

#include <cstdint>
#include <cstring>

#include "arch/avx512bf16/dp_broadcast.h"
#include "arch/isa.h"
#include "core/cpu.h"
#include "linear/format.h"
#include "linear/kformat.h"
#include "linear/qrow.h"

#if !TM_Q512
#error "arch/avx512bf16/ktile512.h needs 16 lanes with AVX-512 BW and VNNI (the avx512bf16 variant)"
#endif

namespace tmk {

constexpr int MT_K512 = 8;  // rows per tile

// Group g (4 k) of a block of 32: 16 channels x 4 k, each byte the channel's v(q) (the low 4 bits from the
// nibbles, plus 16 << p where bit plane p has the bit; IQ4's looked up in kIq4Unsigned, one vpshufb)
template <Format F>
inline __m512i kgroup512(const uint8_t* blk, int g) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i bytes = _mm256_loadu_si256((const __m256i*)(blk + g * 32));
  __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low)),
                                 _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low), 1);
  if constexpr (kspec(F).table)
    w = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)ktable_unsigned<F>())), w);
  // the bits above the low 4 (linear/kformat.h): a 5-bit group's mask adds 16 to the bytes it covers (a masked
  // byte add, AVX-512 BW); Q6_K's 16 bytes, broadcast to the 4 128-bit lanes, hold lane s's 2 bits at 2s, 2s + 1,
  // rotated to bits 4-5 and or-ed in (one ternary logic)
  constexpr int planes = kspec(F).planes;
  const uint8_t* high = khigh_group<planes>(blk, g);
  if constexpr (planes == 1) {
    uint64_t bits;
    std::memcpy(&bits, high, 8);
    w = _mm512_mask_add_epi8(w, _cvtu64_mask64(bits), w, _mm512_set1_epi8(16));
  } else if constexpr (planes == 2) {
    const __m512i all = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)high));
    const __m512i h = _mm512_rolv_epi32(all, _mm512_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0, 30, 30, 30, 30));
    w = _mm512_ternarylogic_epi64(w, h, _mm512_set1_epi8(0x30), 0xF8);
  }
  return w;
}

// Sub-block s of block j of a superblock: the 16 channels' scales and mins (d, dmin as they are where the format has
// no sub-block scales)
template <Format F>
inline void kscales512(const KHeader<F>& h, int j, int s, __m512 d, __m512 dmin, __m512& scale, __m512& mins) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;
  scale = d, mins = dmin;
  if constexpr (khas_sc(S)) {
    scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)h.sc(j * NS + s)))));
    if constexpr (S.has_min)
      mins = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)h.mn(j * NS + s)))));
  }
}

// Row x's integer sums over sub-block s of its block b (isum: 16 channels), scaled and added to its float sums acc:
// the operations, in order, of every tile of the K family on 16 lanes (these and the AMX ones, arch/amx/)
template <Format F>
inline __m512 kfinish512(__m512i isum, const QRow& x, int64_t b, int s, __m512 scale, __m512 mins, __m512 acc) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;
  // the row's sum of q over the sub-block, as a float; every value below is an integer under 2^24, so exact, and
  // the result the same bits as the 8-lane tiles' integer arithmetic (arch/avx2/ktile.h)
  const __m512 sx = _mm512_set1_ps(x.fs[3 * b + (NS == 1 ? 2 : s)]);
  __m512 tot = _mm512_cvtepi32_ps(isum);
  if constexpr (S.zero != 0) tot = _mm512_fnmadd_ps(_mm512_set1_ps((float)S.zero), sx, tot);
  __m512 t = _mm512_mul_ps(tot, scale);
  if constexpr (S.has_min) t = _mm512_fnmadd_ps(mins, sx, t);
  return _mm512_fmadd_ps(t, _mm512_set1_ps(x.d[b]), acc);
}

// The K-quants' superblock sums (linear/kformat.h), sub-block s's part: T += sc isum in int32, and F += f sx in
// float, f the channels' mn (with mins) or sc (with a zero): exact, every partial sum an integer under 2^24
template <Format F>
inline void kadd_sub512(__m512i isum, const QRow& x, int64_t b, int s, __m512i sc, __m512 f, __m512i& T, __m512& Fl) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;
  T = _mm512_add_epi32(T, _mm512_mullo_epi32(isum, sc));
  if constexpr (S.has_min || S.zero) Fl = _mm512_fmadd_ps(f, _mm512_set1_ps(x.fs[3 * b + (NS == 1 ? 2 : s)]), Fl);
}

// ... and the superblock's end: T -= zero F (the sum of sc (isum - zero sx)), then acc += dx (d T - dmin F), in this
// order on every path (the AMX tiles' too)
template <Format F>
inline __m512 kfinish_super512(__m512i T, __m512 Fl, float dx, __m512 d, __m512 dmin, __m512 acc) {
  constexpr KSpec S = kspec(F);
  if constexpr (S.zero != 0)
    T = _mm512_sub_epi32(T, _mm512_mullo_epi32(_mm512_cvtps_epi32(Fl), _mm512_set1_epi32(S.zero)));
  __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(T), d);
  if constexpr (S.has_min) t = _mm512_fnmadd_ps(dmin, Fl, t);
  return _mm512_fmadd_ps(t, _mm512_set1_ps(dx), acc);
}

// sub-block `sub` of a superblock: its channels' sc (int32), and F's factor f (mn, or sc, as floats)
template <Format F>
inline void ksub_scales512(const KHeader<F>& h, int sub, __m512i& sc, __m512& f) {
  sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)h.sc(sub)));
  f = kspec(F).has_min ? _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)h.mn(sub))))
                       : _mm512_cvtepi32_ps(sc);
}

// MT rows' exact integer sums over sub-block s of block b (16 channels each)
template <Format F, int MT>
inline void ksub512(const uint8_t* blk, const QRow* x, int64_t b, int s, __m512i* isum) {
  constexpr int G = kspec(F).sub / 4;  // groups per sub-block
  for (int m = 0; m < MT; ++m) isum[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int gg = 0; gg < G; ++gg) {
    const int g = s * G + gg;
    const __m512i w = kgroup512<F>(blk, g);
    for (int m = 0; m < MT; ++m) isum[m] = dpbusd_broadcast(isum[m], w, (const uint8_t*)x[m].q + b * QK + 4 * g);
  }
}

// The K-quants' tile: each superblock's sub-block sums add up in integers (T, F), scaled once per superblock
template <Format F, int MT>
inline void ktile512_super(const uint8_t* panel, const QRow* x, int64_t s0, int64_t s1, float (*sums)[P],
                           bool prefetch) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = s0 ? _mm512_loadu_ps(sums[m]) : _mm512_setzero_ps();
  for (int64_t sb = s0; sb < s1; ++sb) {
    const KHeader<F> h = ksuperblock<F>(panel, sb, prefetch);
    __m512i T[MT];
    __m512 Fl[MT];
    for (int m = 0; m < MT; ++m) T[m] = _mm512_setzero_si512(), Fl[m] = _mm512_setzero_ps();
    for (int j = 0; j < S.sb / QK; ++j) {
      const int64_t b = sb * (S.sb / QK) + j;
      for (int s = 0; s < NS; ++s) {
        __m512i isum[MT], sc;
        __m512 f;
        ksub512<F, MT>(h.block(j), x, b, s, isum);
        ksub_scales512<F>(h, j * NS + s, sc, f);
        for (int m = 0; m < MT; ++m) kadd_sub512<F>(isum[m], x[m], b, s, sc, f, T[m], Fl[m]);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h.d()));
    const __m512 dmin = S.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h.dmin())) : d;
    for (int m = 0; m < MT; ++m) acc[m] = kfinish_super512<F>(T[m], Fl[m], x[m].d[sb * (S.sb / QK)], d, dmin, acc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(sums[m], acc[m]);
}

template <Format F, int MT>
inline void ktile512(const uint8_t* panel, const QRow* x, int64_t s0, int64_t s1, float (*sums)[P], bool prefetch) {
  if constexpr (ksuper(F)) return ktile512_super<F, MT>(panel, x, s0, s1, sums, prefetch);
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;  // sub-blocks per block of 32
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = s0 ? _mm512_loadu_ps(sums[m]) : _mm512_setzero_ps();
  for (int64_t sb = s0; sb < s1; ++sb) {
    const KHeader<F> h = ksuperblock<F>(panel, sb, prefetch);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h.d()));
    const __m512 dmin = S.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h.dmin())) : d;
    for (int j = 0; j < S.sb / QK; ++j) {
      const int64_t b = sb * (S.sb / QK) + j;
      for (int s = 0; s < NS; ++s) {
        __m512i isum[MT];
        ksub512<F, MT>(h.block(j), x, b, s, isum);
        __m512 scale, mins;
        kscales512<F>(h, j, s, d, dmin, scale, mins);
        for (int m = 0; m < MT; ++m) acc[m] = kfinish512<F>(isum[m], x[m], b, s, scale, mins, acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(sums[m], acc[m]);
}

}  // namespace tmk
