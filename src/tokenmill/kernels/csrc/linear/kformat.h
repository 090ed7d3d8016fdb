// The K family of quantized formats: ggml's K-quants (Q4_K, Q5_K, Q6_K), the legacy formats llama-quantize
// falls back to (Q5_0, Q5_1, Q4_1), the non-linear IQ4_NL and IQ4_XS, and MXFP4 (OCP microscaling: FP4 e2m1 values
// under a power-of-two scale per 32, as gpt-oss ships its experts), each multiplied where it lies by the
// integer tiles of linear/kquant.h.
//
// All of them are one shape (linear/format.h: KSpec): an unsigned q of 4, 5 or 6 bits per weight, its value v(q)
// (q itself, or IQ4's table entry), and per sub-block an affine map w = scale * (v(q) - zero) - min, where
//   Q4_K, Q5_K: superblocks of 256 = 8 sub-blocks of 32; scale = d * sc, min = dmin * mn (sc, mn 6-bit);
//   Q6_K:       superblocks of 256 = 16 sub-blocks of 16; scale = d * sc (sc int8), zero = 32, no min;
//   Q5_0:       blocks of 32; scale = d, zero = 16;   Q5_1, Q4_1: blocks of 32; scale = d, min = -m;
//   IQ4_NL:     blocks of 32; scale = d; v(q) = kIq4Unsigned[q] = ggml's kvalues_iq4nl[q] + 128, zero = 128;
//   IQ4_XS:     superblocks of 256 = 8 sub-blocks of 32; scale = d * sc, sc = ggml's 6-bit scale - 32 (int8);
//               v(q) and zero as IQ4_NL's.
//   MXFP4:      blocks of 32; scale = d = 2^(e - 128) (the block's e8m0 exponent e, halved: the table is e2m1 x 2,
//               ggml's kvalues_mxfp4), held exactly as fp16 where e is in [104, 143] (others: kernels/kformats.py
//               refuses the tensor, which then loads dequantized); v(q) = kMxfp4Unsigned[q], zero = 128.
// Every one of those numbers is ggml's own (d, dmin, m fp16; sc, mn small integers), so a GGUF's blocks repack
// without loss: only their order changes (kernels/kformats.py), and a few bits of padding. IQ4's 4-bit q stay
// 4-bit in the panels: the tiles look their values up (a byte shuffle) as they unpack a group.
//
// A panel's superblock (P = 16 channels, sb k):
//   header: fp16 d[P]; fp16 dmin[P] (has_min); int8 sc[subs][P]; uint8 mn[subs][P] (has_min)
//           (sc and mn only with more than one sub-block: a legacy block's scale is d and its min dmin)
//   then sb / 32 blocks of 32 k, each:
//     uint8 nib[8][8][4]     Q4_0's layout: byte [g][c][i] holds channel c at k = 4g + i in its low nibble and
//                            channel c + 8 in its high one: the low 4 bits of q
//     uint8 high[8][8 planes] the bits of q above the low 4, group by group; of group g's 64 weights, j = 4c + i
//                            (channel c at k = 4g + i) has them at
//                              5-bit q: bit j of high[g] as a little-endian uint64 (byte j / 8, bit j % 8);
//                              Q6_K:    bits 2 (j / 16) and 2 (j / 16) + 1 of byte j % 16 (its 2 bits, h = q >> 4)
// so one 32-byte load and a shift give a group's 16 channels x 4 k as bytes (j is their byte index, channels 8-15
// from 32); a 5-bit group's high bits are one 64-bit mask over those bytes (an AVX-512 masked add), and Q6_K's come
// to bits 4-5 of each byte with one broadcast load and a shift per 16 bytes (arch/avx2/ktile.h: kgroup). Bytes per
// weight: Q4_K 4.625 bits (ggml's 4.5), Q5_K 5.625 (5.5), Q6_K 6.5625 (the same),
// Q5_0 5.5 (the same), Q5_1 6 (the same), Q4_1 5 (the same), IQ4_NL 4.5 (the same), IQ4_XS 4.3125 (4.25).
//
// The product against a quantized row (linear/qrow.h): per sub-block the exact integer sum isum = sum of v(q) * qx,
// and sx the row's sum of qx over the sub-block (QRow::s). The K-quants (Q4_K, Q5_K, Q6_K: ksuper) take rows with
// one scale per superblock, as ggml's Q8_K, and sum a superblock in integers before any float:
//   T = sum of sc * isum, F = sum of f * sx (f = mn with mins, sc with a zero: exact in float, under 2^24)
// (|T| < 2^28: Q6_K's 16 sub-blocks of 16 k, |q| <= 63, |qx| <= 127, |sc| <= 128; Q4_K's and Q5_K's less; so
// any order of the additions gives the same T)
//   out += dx * (d * (T - zero * F) - dmin * F)
// (ggml's own arithmetic), so the scales cost once per superblock and the AMX tiles can take a superblock at once
// (arch/amx/amx_ksuper.h). The others take rows with a scale per block of 32, and per sub-block
// out += dx * (scale * (isum - zero * sx) - min * sx). IQ4's v(q) - zero is the signed table entry (-127 .. 113), so
// isum - 128 sx is ggml's sum of table * qx exactly.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/cpu.h"
#include "core/simd.h"
#include "linear/format.h"

namespace tmk {

// IQ4's 16 non-linear levels (ggml's kvalues_iq4nl), as they are (vpmaddubsw's sign trick takes them:
// arch/avx2/ktile.h) and + 128, the unsigned bytes vpdpbusd and TDPBSUD multiply (v(q) everywhere else)
alignas(16) constexpr int8_t kIq4Signed[16] = {-127, -104, -83, -65, -49, -35, -22, -10,  //
                                               1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) constexpr uint8_t kIq4Unsigned[16] = {1,   24,  45,  63,  79,  93,  106, 118,  //
                                                  129, 141, 153, 166, 181, 197, 217, 241};
static_assert(kIq4Unsigned[0] == kIq4Signed[0] + 128 && kIq4Unsigned[15] == kIq4Signed[15] + 128);
// MXFP4's 16 values: FP4 e2m1 (bit 3 the sign) doubled to integers (ggml's kvalues_mxfp4), and + 128
alignas(16) constexpr int8_t kMxfp4Signed[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) constexpr uint8_t kMxfp4Unsigned[16] = {128, 129, 130, 131, 132, 134, 136, 140,  //
                                                    128, 127, 126, 125, 124, 122, 120, 116};
static_assert(kMxfp4Unsigned[7] == kMxfp4Signed[7] + 128 && kMxfp4Unsigned[15] == kMxfp4Signed[15] + 128);

// a table format's values, signed and + 128
template <Format F>
constexpr const int8_t* ktable_signed() {
  return kspec(F).table == 2 ? kMxfp4Signed : kIq4Signed;
}
template <Format F>
constexpr const uint8_t* ktable_unsigned() {
  return kspec(F).table == 2 ? kMxfp4Unsigned : kIq4Unsigned;
}

// where a superblock header's parts start
template <Format F>
struct KHeader {
  static constexpr KSpec S = kspec(F);
  const uint8_t* at;
  const uint16_t* d() const { return (const uint16_t*)at; }
  const uint16_t* dmin() const { return (const uint16_t*)at + P; }
  const int8_t* sc(int s) const { return (const int8_t*)at + 2 * P * (1 + S.has_min) + s * P; }
  const uint8_t* mn(int s) const { return (const uint8_t*)at + 2 * P * (1 + S.has_min) + (ksubs(S) + s) * P; }
  // the blocks of 32 k that follow
  const uint8_t* block(int64_t j) const { return at + kheader_bytes(S) + j * kblock_bytes(S); }
  // channel c's scale and min in sub-block s, as floats (exact: an fp16 times a 6- or 8-bit integer)
  float scale(int s, int c) const {
    const float dc = half_to_float(d()[c]);
    return khas_sc(S) ? dc * (float)sc(s)[c] : dc;
  }
  float min(int s, int c) const {
    if constexpr (!S.has_min) return 0.f;
    const float mc = half_to_float(dmin()[c]);
    return khas_sc(S) ? mc * (float)mn(s)[c] : mc;
  }
};

// superblock sb of a panel, its weights asked for ahead where `prefetch` (the tiles' first pass over a span)
template <Format F>
inline KHeader<F> ksuperblock(const uint8_t* panel, int64_t sb, bool prefetch) {
  const KHeader<F> h{panel + sb * ksb_bytes(kspec(F))};
  if (prefetch)
    for (int64_t off = 0; off < ksb_bytes(kspec(F)); off += 64) prefetch_weights(h.at + off);
  return h;
}

// where weight j = 4c + i of a group keeps its bits above the low 4 (the layout above): the byte of the group's
// 8 * Planes, and the shift within it; kvalue reads them there, linear/repack.h writes them
template <int Planes>
constexpr int khigh_byte(int j) { return Planes == 1 ? j / 8 : j % 16; }
template <int Planes>
constexpr int khigh_shift(int j) { return Planes == 1 ? j % 8 : 2 * (j / 16); }
template <int Planes, typename Byte>  // (uint8_t or const uint8_t)
inline Byte* khigh_group(Byte* blk, int g) { return blk + QK / 2 * P + g * 8 * Planes; }

// the bits above the low 4 of weight j of group g in a block of 32
template <int Planes>
inline int32_t khigh(const uint8_t* blk, int g, int j) {
  const uint8_t byte = khigh_group<Planes>(blk, g)[khigh_byte<Planes>(j)];
  return (byte >> khigh_shift<Planes>(j)) & ((1 << Planes) - 1);
}

// channel c's v(q) at k = kk of a block of 32 (q: 0 .. 2^(4 + planes) - 1; a table format's: its unsigned entry)
template <Format F>
inline int32_t kvalue(const uint8_t* blk, int c, int kk) {
  const int g = kk / 4, i = kk % 4;
  const uint8_t byte = blk[g * 32 + (c % 8) * 4 + i];
  int32_t v = c < 8 ? byte & 15 : byte >> 4;
  if constexpr (kspec(F).planes) v |= khigh<kspec(F).planes>(blk, g, 4 * c + i) << 4;
  if constexpr (kspec(F).table) return ktable_unsigned<F>()[v];
  return v;
}

}  // namespace tmk
