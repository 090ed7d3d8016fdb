// The K family's register tiles on ymm registers (AVX2 with F16C: every x86 variant; with VNNI, vpdpbusd in place of
// vpmaddubsw + vpmaddwd). A group's 32 nibble bytes give channels 0-7 (low nibbles) and 8-15 (high ones, shifted
// down) as two registers of 8 channels x 4 k; the bits above them (5- and 6-bit q) come from one broadcast load
// (khigh_bits). q is unsigned (0..63) and the row's q signed, as vpmaddubsw and vpdpbusd take them.
//
// vpmaddubsw's 16-bit pair sums saturate above 32767: a pair is at most 2 * 127 * (2^(4 + planes) - 1), so the
// 16-bit sums widen to 32 bits every 8 groups (4-bit), 4 (5-bit) or 2 (6-bit), before they could. The sums are
// exact either way; the scaling is linear/kformat.h's. linear/kquant.h picks this file on x86.
//
// IQ4 (the table formats) looks each nibble's value up with vpshufb. vpdpbusd takes the unsigned table (1 .. 241,
// zero 128) as it takes any q; vpmaddubsw would saturate on it (2 * 241 * 127 > 32767), so without VNNI the tiles
// take the signed table t and multiply |t| by qx with t's sign (vpsignb): 2 * 127 * 127 fits, the sums are of t * qx
// itself (their zero 0: ksum_zero), and they widen every group.
#pragma once

#include <cstdint>
#include <cstring>

#include "arch/avx2/qtile.h"
#include "arch/isa.h"
#include "linear/format.h"
#include "linear/kformat.h"
#include "linear/qrow.h"

namespace tmk {

// Rows per tile: each row's accumulators and sums fit the 16 (or 32) vector registers. Without VNNI the 16-bit sums
// widen straight into the K-quants' T (vpmaddwd by the sub-block's scales), and 4 rows fit: the 2 of before ran
// Q4_K 1.3x and Q5_K 1.4x slower at 16 rows on a Zen 3. Q6_K's 16-bit sums widen every 2 groups, and 4 rows spill
// there (0.6x): 2
template <Format F>
constexpr int kmt() {
  return TM_REGS32 ? 4 : (TM_VNNI ? 3 : (kspec(F).planes == 2 ? 2 : 4));
}

// Group g's bits above the low 4 (linear/kformat.h) at bits 4 and up of each weight's byte: h[0] bytes 0-31
// (channels 0-7), h[1] 32-63 (8-15). 5-bit q: the group's 64-bit mask spread to bytes (one broadcast load, then per
// half a byte shuffle, an and and a compare), 16 where the bit is set. Q6_K: one broadcast of the group's 16 bytes
// and per half a shift per 128-bit lane and an and (its two bit planes of before, spread as the 5-bit mask is, took
// ~22 instructions a group against 4 here: one row 1.35x faster on the Xeon's avx2 variant)
template <int Planes>
inline void khigh_bits(const uint8_t* at, __m256i* h) {
  if constexpr (Planes == 1) {
    int64_t word;
    std::memcpy(&word, at, 8);
    const __m256i all = _mm256_set1_epi64x(word);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i from0 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    // the second half's bytes 4-7 of the word, moved down to 0-3: one constant fewer live in the tile's loop
    const __m256i high = _mm256_srli_epi64(all, 32), m = _mm256_set1_epi8(0x10);
    h[0] = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(all, from0), bit), bit), m);
    h[1] = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(high, from0), bit), bit), m);
  } else {
    static_assert(Planes == 2, "4-, 5- and 6-bit q");
    const __m256i all = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)at)), m = _mm256_set1_epi8(0x30);
    h[0] = _mm256_and_si256(_mm256_sllv_epi32(all, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)), m);  // bits 0-1, 2-3
    h[1] = _mm256_and_si256(_mm256_srlv_epi32(all, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), m);  // bits 4-5, 6-7
  }
}

// the zero the integer sums carry (linear/kformat.h): the format's, but none for the signed IQ4 table (no VNNI)
template <Format F>
constexpr int ksum_zero() {
  return kspec(F).table && !TM_VNNI ? 0 : kspec(F).zero;
}

// group g of a block: w[0] channels 0-7, w[1] 8-15, as q bytes [c][4 k] (IQ4: their table values, signed
// without VNNI)
template <Format F>
inline void kgroup(const uint8_t* blk, int g, __m256i* w) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i bytes = _mm256_loadu_si256((const __m256i*)(blk + g * 32));
  w[0] = _mm256_and_si256(bytes, low);
  w[1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
  if constexpr (kspec(F).table) {
    const __m256i lut = _mm256_broadcastsi128_si256(
        _mm_load_si128(TM_VNNI ? (const __m128i*)ktable_unsigned<F>() : (const __m128i*)ktable_signed<F>()));
    w[0] = _mm256_shuffle_epi8(lut, w[0]);
    w[1] = _mm256_shuffle_epi8(lut, w[1]);
  }
  if constexpr (kspec(F).planes > 0) {
    __m256i h[2];
    khigh_bits<kspec(F).planes>(khigh_group<kspec(F).planes>(blk, g), h);
    w[0] = _mm256_or_si256(w[0], h[0]);
    w[1] = _mm256_or_si256(w[1], h[1]);
  }
}

// Ask for block j of a superblock's weights ahead (with the header, for the first), as the tiles reach it. Asking for
// a whole K-quant superblock at once (37-53 lines) held the one-row tiles to 17-23 GB/s on a Zen 3, whose two cores
// read 28; a block at a time they read 23-29 (docs/benchmarks.md)
template <Format F>
inline void kprefetch_block(const KHeader<F>& h, int64_t j) {
  for (const uint8_t* at = j ? h.block(j) : h.at; at < h.block(j + 1); at += 64) prefetch_weights(at);
}

// A span's groups as kgroup gives them, decoded once for the tiles that follow: superblocks [s0, s1) of a panel
// into `dec`, block after block, 64 bytes a group (channels 0-7, then 8-15): QK * P bytes a block of 32 k. Where a
// panel takes several tiles, each decoded every group again: a Q6_K group was ~25 instructions against a row's ~5
// in the 2-row tiles of the AVX2 build, so 16 rows spent most of their time decoding. (Its ~9 now still gain from
// the decoded span: without it 16 rows ran 1.45x slower on the Xeon's avx2 variant, and tiles of 3 or 4 rows
// 1.09-1.18x.)
template <Format F>
inline void kdecode_span(const uint8_t* panel, int64_t s0, int64_t s1, uint8_t* dec) {
  constexpr int64_t BPS = kspec(F).sb / QK;  // blocks of 32 per superblock
  for (int64_t sb = s0; sb < s1; ++sb) {
    const KHeader<F> h = ksuperblock<F>(panel, sb, false);
    for (int64_t j = 0; j < BPS; ++j) {
      if (prefetch_quant_rows) kprefetch_block(h, j);
      for (int g = 0; g < QK / 4; ++g) {
        __m256i w[2];
        kgroup<F>(h.block(j), g, w);
        uint8_t* at = dec + (((sb - s0) * BPS + j) * (QK / 4) + g) * 64;
        _mm256_store_si256((__m256i*)at, w[0]);
        _mm256_store_si256((__m256i*)(at + 32), w[1]);
      }
    }
  }
}

// The decoded span for a panel's tiles (thread-local, 32-byte aligned), or null where decoding in each tile costs
// no more or the span would not fit. With bits above the low 4 (5- and 6-bit q) a group's decoding costs more than
// a row's products; a 4-bit group's is a few instructions, about what storing and reloading it takes (Zen 3, 16
// rows: Q5_0 1.6x, Q6_K 1.27x, Q4_K 0.94x).
template <Format F>
inline const uint8_t* kdecoded(const uint8_t* panel, int64_t s0, int64_t s1) {
  constexpr int64_t CAP = 16 << 10;  // a span of SPAN_BYTES decodes to at most ~15 KB in every format
  alignas(64) static thread_local uint8_t buf[CAP];
  if (kspec(F).planes == 0 || (s1 - s0) * kspec(F).sb * P > CAP) return nullptr;
  kdecode_span<F>(panel, s0, s1, buf);
  return buf;
}

// block j of the span's superblock i in a decoded span, or null
template <Format F>
inline const uint8_t* kblock_decoded(const uint8_t* dec, int64_t i, int64_t j) {
  return dec ? dec + (i * (kspec(F).sb / QK) + j) * QK * P : nullptr;
}

// MT rows' exact sums of v(q) * qx over sub-block s of block b (groups [s G, (s + 1) G)), added to acc[m][half]: with
// VNNI the 32-bit sums themselves; without, vpmaddwd of the 16-bit sums by `mul` (ones, or the K-quants' sub-block
// scales as 16-bit pairs: then acc gains sc * the sums, as T does) each time they widen. `dec`: the block's groups
// decoded (kdecode_span), or null to decode them here
template <Format F, int MT>
inline void ksub_sums(const uint8_t* blk, const uint8_t* dec, const QRow* x, int64_t b, int s,
                      [[maybe_unused]] const __m256i* mul, __m256i (*acc)[2]) {
  constexpr KSpec S = kspec(F);
  constexpr int G = S.sub / 4;  // groups per sub-block
#if !TM_VNNI
  constexpr int WIDEN = S.table ? 1 : (S.planes == 0 ? 8 : (S.planes == 1 ? 4 : 2));
  __m256i p16[MT][2];
  for (int m = 0; m < MT; ++m) p16[m][0] = p16[m][1] = _mm256_setzero_si256();
#endif
  for (int gg = 0; gg < G; ++gg) {
    const int g = s * G + gg;
    __m256i w[2];
    if (dec) {
      w[0] = _mm256_load_si256((const __m256i*)(dec + g * 64));
      w[1] = _mm256_load_si256((const __m256i*)(dec + g * 64 + 32));
    } else {
      kgroup<F>(blk, g, w);
    }
#if !TM_VNNI
    __m256i mag[2] = {w[0], w[1]};  // the unsigned side of vpmaddubsw: q, or IQ4's |t| (no entry is 0)
    if constexpr (S.table) mag[0] = _mm256_abs_epi8(w[0]), mag[1] = _mm256_abs_epi8(w[1]);
#endif
    for (int m = 0; m < MT; ++m) {
      int32_t four;
      std::memcpy(&four, x[m].q + b * QK + 4 * g, 4);
      const __m256i xb = _mm256_set1_epi32(four);
#if TM_VNNI
      acc[m][0] = tm_dpbusd256(acc[m][0], w[0], xb);
      acc[m][1] = tm_dpbusd256(acc[m][1], w[1], xb);
#else
      for (int hh = 0; hh < 2; ++hh) {
        __m256i xs = xb;  // the signed side: qx, or IQ4's qx with t's sign
        if constexpr (S.table) xs = _mm256_sign_epi8(xb, w[hh]);
        p16[m][hh] = _mm256_add_epi16(p16[m][hh], _mm256_maddubs_epi16(mag[hh], xs));
      }
#endif
    }
#if !TM_VNNI
    if ((gg + 1) % WIDEN == 0 || gg == G - 1)
      for (int m = 0; m < MT; ++m)
        for (int hh = 0; hh < 2; ++hh) {
          acc[m][hh] = _mm256_add_epi32(acc[m][hh], _mm256_madd_epi16(p16[m][hh], mul[hh]));
          p16[m][hh] = _mm256_setzero_si256();
        }
#endif
  }
}

// a tile's float sums: from `sums` where it goes on from superblock s0 > 0, else zero; and back
template <int MT>
inline void kacc_begin(__m256 (*acc)[2], const float (*sums)[P], int64_t s0) {
  for (int m = 0; m < MT; ++m)
    for (int hh = 0; hh < 2; ++hh) acc[m][hh] = s0 ? _mm256_loadu_ps(sums[m] + 8 * hh) : _mm256_setzero_ps();
}
template <int MT>
inline void kacc_end(const __m256 (*acc)[2], float (*sums)[P]) {
  for (int m = 0; m < MT; ++m)
    for (int hh = 0; hh < 2; ++hh) _mm256_storeu_ps(sums[m] + 8 * hh, acc[m][hh]);
}

// F = the sum of f sx over a superblock's sub-blocks, in their order (f the channels' mn with mins, or sc with a
// zero): exact, every partial sum an integer under 2^24. Summed after the superblock's groups, so that the tiles do
// not hold it in registers through them (avxvnni 16-64 rows 1.05-1.19x, avx2 1.00-1.04x: docs/benchmarks.md)
template <Format F, int MT>
inline void ksuper_f(const KHeader<F>& h, const QRow* x, int64_t sb, __m256 (*Fl)[2]) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;
  for (int m = 0; m < MT; ++m) Fl[m][0] = Fl[m][1] = _mm256_setzero_ps();
  if constexpr (S.has_min || S.zero)
    for (int j = 0; j < S.sb / QK; ++j)
      for (int s = 0; s < NS; ++s) {
        const int64_t b = sb * (S.sb / QK) + j;
        const uint8_t* f8 = S.has_min ? h.mn(j * NS + s) : (const uint8_t*)h.sc(j * NS + s);
        for (int hh = 0; hh < 2; ++hh) {
          const __m128i v = _mm_loadl_epi64((const __m128i*)(f8 + 8 * hh));
          const __m256 f = _mm256_cvtepi32_ps(S.has_min ? _mm256_cvtepu8_epi32(v) : _mm256_cvtepi8_epi32(v));
          for (int m = 0; m < MT; ++m)
            Fl[m][hh] = _mm256_fmadd_ps(f, _mm256_set1_ps(x[m].fs[3 * b + (NS == 1 ? 2 : s)]), Fl[m][hh]);
        }
      }
}

// The K-quants' tile (linear/kformat.h): each superblock's sub-block sums add up in integers, T += sc isum, and F
// (ksuper_f); once per superblock T -= zero F and acc += dx (d T - dmin F), as on every path
template <Format F, int MT>
inline void ktile_super(const uint8_t* panel, const QRow* x, int64_t s0, int64_t s1, float (*sums)[P], bool prefetch,
                        const uint8_t* dec) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;
  __m256 acc[MT][2];
  kacc_begin<MT>(acc, sums, s0);
  for (int64_t sb = s0; sb < s1; ++sb) {
    const KHeader<F> h = ksuperblock<F>(panel, sb, false);
    __m256i T[MT][2];
    for (int m = 0; m < MT; ++m) T[m][0] = T[m][1] = _mm256_setzero_si256();
    for (int j = 0; j < S.sb / QK; ++j) {
      const int64_t b = sb * (S.sb / QK) + j;
      if (prefetch_quant_rows && prefetch) kprefetch_block(h, j);
      for (int s = 0; s < NS; ++s) {
        __m256i sc[2];
        for (int hh = 0; hh < 2; ++hh) {
          const __m128i sc8 = _mm_loadl_epi64((const __m128i*)(h.sc(j * NS + s) + 8 * hh));
#if TM_VNNI
          sc[hh] = _mm256_cvtepi8_epi32(sc8);
#else
          sc[hh] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));  // each channel's sc in both 16-bit halves
#endif
        }
#if TM_VNNI  // the sub-block's 32-bit sums, then T += sc isum
        __m256i isum[MT][2];
        for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
        ksub_sums<F, MT>(h.block(j), kblock_decoded<F>(dec, sb - s0, j), x, b, s, nullptr, isum);
        for (int m = 0; m < MT; ++m)
          for (int hh = 0; hh < 2; ++hh) T[m][hh] = _mm256_add_epi32(T[m][hh], _mm256_mullo_epi32(isum[m][hh], sc[hh]));
#else  // the 16-bit sums widen straight into T, times sc (|T| < 2^28: linear/kformat.h)
        ksub_sums<F, MT>(h.block(j), kblock_decoded<F>(dec, sb - s0, j), x, b, s, sc, T);
#endif
      }
    }
    __m256 Fl[MT][2];
    ksuper_f<F, MT>(h, x, sb, Fl);
    for (int hh = 0; hh < 2; ++hh) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h.d() + 8 * hh)));
      const __m256 dmin = S.has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h.dmin() + 8 * hh))) : d;
      for (int m = 0; m < MT; ++m) {
        __m256i Tm = T[m][hh];
        if constexpr (S.zero != 0)
          Tm = _mm256_sub_epi32(Tm, _mm256_mullo_epi32(_mm256_cvtps_epi32(Fl[m][hh]), _mm256_set1_epi32(S.zero)));
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(Tm), d);
        if constexpr (S.has_min) t = _mm256_fnmadd_ps(dmin, Fl[m][hh], t);
        acc[m][hh] = _mm256_fmadd_ps(t, _mm256_set1_ps(x[m].d[sb * (S.sb / QK)]), acc[m][hh]);
      }
    }
  }
  kacc_end<MT>(acc, sums);
}

// MT rows x the panel's 16 channels over superblocks [s0, s1): from zero at s0 = 0, else on from `sums`;
// `prefetch`: ask for the weights ahead (kpanel's first tile); `dec`: the span decoded (kdecoded), or null
template <Format F, int MT>
inline void ktile(const uint8_t* panel, const QRow* x, int64_t s0, int64_t s1, float (*sums)[P], bool prefetch,
                  const uint8_t* dec) {
  if constexpr (ksuper(F)) return ktile_super<F, MT>(panel, x, s0, s1, sums, prefetch, dec);
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub, Z = ksum_zero<F>();
  __m256 acc[MT][2];
  kacc_begin<MT>(acc, sums, s0);
  for (int64_t sb = s0; sb < s1; ++sb) {
    const KHeader<F> h = ksuperblock<F>(panel, sb, prefetch_quant_rows && prefetch);
    __m256 d[2], dmin[2];
    for (int hh = 0; hh < 2; ++hh) {
      d[hh] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h.d() + 8 * hh)));
      dmin[hh] = S.has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h.dmin() + 8 * hh))) : d[hh];
    }
    for (int j = 0; j < S.sb / QK; ++j) {
      const int64_t b = sb * (S.sb / QK) + j;
      for (int s = 0; s < NS; ++s) {
        __m256i isum[MT][2];
        for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
        const __m256i ones[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(1)};
        ksub_sums<F, MT>(h.block(j), kblock_decoded<F>(dec, sb - s0, j), x, b, s, ones, isum);
        __m256 scale[2], mins[2];
        for (int hh = 0; hh < 2; ++hh) {
          scale[hh] = d[hh], mins[hh] = dmin[hh];
          if constexpr (khas_sc(S)) {
            const __m128i sc = _mm_loadl_epi64((const __m128i*)(h.sc(j * NS + s) + 8 * hh));
            scale[hh] = _mm256_mul_ps(d[hh], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            if constexpr (S.has_min) {
              const __m128i mn = _mm_loadl_epi64((const __m128i*)(h.mn(j * NS + s) + 8 * hh));
              mins[hh] = _mm256_mul_ps(dmin[hh], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
            }
          }
        }
        for (int m = 0; m < MT; ++m) {
          // the row's sum of q over the sub-block as a float (QRow::fs): every value here is an integer under 2^24,
          // so the float arithmetic is exact, as the integer one was
          const __m256 dx = _mm256_set1_ps(x[m].d[b]), fsx = _mm256_set1_ps(x[m].fs[3 * b + (NS == 1 ? 2 : s)]);
          for (int hh = 0; hh < 2; ++hh) {
            __m256 tot = _mm256_cvtepi32_ps(isum[m][hh]);
            if constexpr (Z != 0) tot = _mm256_fnmadd_ps(_mm256_set1_ps((float)Z), fsx, tot);
            __m256 t = _mm256_mul_ps(tot, scale[hh]);
            if constexpr (S.has_min) t = _mm256_fnmadd_ps(mins[hh], fsx, t);
            acc[m][hh] = _mm256_fmadd_ps(t, dx, acc[m][hh]);
          }
        }
      }
    }
  }
  kacc_end<MT>(acc, sums);
}

}  // namespace tmk
