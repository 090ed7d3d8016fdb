// The packed weight formats (kernels/formats.py packs them; the ids are its FORMATS) and their layouts: every format
// keeps P=16 output channels per panel, panels back to back, and a panel is K / block_k blocks of block_bytes.
//   bf16:  panel = [K/2][P][2] bfloat16: k in pairs, so one load gives W channels at k and k + 1 as 32-bit lanes,
//          and a bf16 becomes a float with one shift (k) or one mask (k + 1); K is even (padded)
//   f32:   panel = [K][P] float32
//   Q8_0:  K/32 blocks of { fp16 d[16]; int8  q[8][16][4] }  q[g][c][i] = w[c][4g + i];  w = d * q
//   Q4_0:  K/32 blocks of { fp16 d[16]; uint8 q[8][8][4] }   q[g][c][i] = w[c][4g + i] | w[c + 8][4g + i] << 4
//          (w in 0..15, the weight is d * (w - 8))
//   K family (Q4_K, Q5_K, Q6_K, the legacy Q5_0, Q5_1, Q4_1, and the non-linear IQ4_NL, IQ4_XS): linear/kformat.h
// The dense formats keep a panel's weights k-major (for each k, the P channels side by side), so one vector load
// gives W channels at one k; the quantized ones group 4 k per channel for 8-bit integer dot products (linear/quant.h).
// Which kernels multiply each format: linear/type_traits.h.
#pragma once

#include <cstdint>

#include "core/vec.h"

namespace tmk {

enum Format {
  BF16 = 0, Q8_0 = 1, Q4_0 = 2, F32 = 3, Q4_K = 4, Q5_K = 5, Q6_K = 6, Q5_0 = 7, Q5_1 = 8, Q4_1 = 9,
  IQ4_NL = 10, IQ4_XS = 11, MXFP4 = 12
};
constexpr int QK = 32;  // weights per quantization block

// The K family: every weight an unsigned q of 4, 5 or 6 bits, in superblocks of `sb` k whose sub-blocks of `sub` k
// each have a scale (and a min): w = d * sc * (v(q) - zero) - dmin * mn, v(q) = q, or with a `table` the 4-bit q's
// entry of IQ4's or MXFP4's table, offset to unsigned (linear/kformat.h gives the layout)
struct KSpec {
  int sb;        // k per superblock: 256 (K-quants) or 32 (the legacy formats, one sub-block each)
  int sub;       // k per sub-block: 32, or 16 (Q6_K)
  int planes;    // bits above the low 4, one bit plane each: 0 (4-bit), 1 (5-bit), 2 (6-bit)
  bool has_min;  // the superblock has dmin and its sub-blocks mn (Q4_K, Q5_K, Q4_1, Q5_1)
  int zero;      // subtracted from v(q) before the scale: 32 (Q6_K), 16 (Q5_0), 128 (IQ4's offset table), else 0
  int table = 0;  // v(q) = q (0), or the 4-bit q's entry of a table (linear/kformat.h): IQ4's (1), MXFP4's (2)
};
// indexed by Format - Q4_K
constexpr KSpec kSpecs[] = {
    {256, 32, 0, true, 0},   // Q4_K
    {256, 32, 1, true, 0},   // Q5_K
    {256, 16, 2, false, 32}, // Q6_K
    {32, 32, 1, false, 16},  // Q5_0
    {32, 32, 1, true, 0},    // Q5_1
    {32, 32, 0, true, 0},    // Q4_1
    {32, 32, 0, false, 128, 1},   // IQ4_NL
    {256, 32, 0, false, 128, 1},  // IQ4_XS: int8 sc = ggml's 6-bit scale - 32
    {32, 32, 0, false, 128, 2},   // MXFP4: d = the block's power of two (e8m0) / 2, held as fp16
};
constexpr bool is_kfamily(Format f) { return f >= Q4_K; }
constexpr KSpec kspec(Format f) { return kSpecs[f - Q4_K]; }
// The K-quants proper (Q4_K, Q5_K, Q6_K): their rows are quantized with one scale per superblock of 256 (ggml's
// Q8_K), and each superblock's sub-block products are summed in integers (linear/kformat.h)
constexpr bool ksuper(Format f) { return f == Q4_K || f == Q5_K || f == Q6_K; }
// k per activation scale in the rows a format's tiles read (linear/qrow.h)
constexpr int64_t row_group(Format f) { return ksuper(f) ? 256 : QK; }
constexpr int ksubs(KSpec s) { return s.sb / s.sub; }  // sub-blocks per superblock
constexpr bool khas_sc(KSpec s) { return ksubs(s) > 1; }  // one sub-block: its scale is d, its min dmin
// a superblock's header: fp16 d[P]; fp16 dmin[P] (has_min); int8 sc[subs][P] and uint8 mn[subs][P] (has_min), the
// last two only with sub-blocks
constexpr int64_t kheader_bytes(KSpec s) {
  return 2 * P * (1 + s.has_min) + (khas_sc(s) ? ksubs(s) * P * (1 + s.has_min) : 0);
}
// one block of 32 k: the low nibbles as Q4_0's (256 bytes), then the bits above them, `planes` x 64 bytes
// (linear/kformat.h)
constexpr int64_t kblock_bytes(KSpec s) { return QK / 2 * P + s.planes * 64; }
constexpr int64_t ksb_bytes(KSpec s) { return kheader_bytes(s) + s.sb / QK * kblock_bytes(s); }

struct FormatLayout {
  int64_t block_k;      // k per block of a panel (K is a whole number of them)
  int64_t block_bytes;  // bytes of one block of a panel's P channels
};

// indexed by Format
constexpr FormatLayout kLayouts[] = {
    {2, 2 * P * 2},            // BF16: one k pair
    {QK, 2 * P + QK * P},      // Q8_0: P fp16 scales, P x 32 int8
    {QK, 2 * P + QK / 2 * P},  // Q4_0: P fp16 scales, P x 32 4-bit (two a byte)
    {1, P * 4},                // F32: one k
    {256, ksb_bytes(kSpecs[0])}, {256, ksb_bytes(kSpecs[1])}, {256, ksb_bytes(kSpecs[2])},  // K-quants: superblocks
    {QK, ksb_bytes(kSpecs[3])},  {QK, ksb_bytes(kSpecs[4])},  {QK, ksb_bytes(kSpecs[5])},   // legacy: blocks
    {QK, ksb_bytes(kSpecs[6])},  {256, ksb_bytes(kSpecs[7])},                               // IQ4_NL, IQ4_XS
    {QK, ksb_bytes(kSpecs[8])},                                                             // MXFP4
};

// bytes of one quantized block of a panel: P fp16 scales, then P x 32 values (int8, or two 4-bit per byte)
constexpr int64_t quant_block_bytes(Format f) { return kLayouts[f].block_bytes; }

inline int64_t panel_bytes(Format f, int64_t K) { return K / kLayouts[f].block_k * kLayouts[f].block_bytes; }

// The raw weight value of channel c at k = kk of a quantized block (Q4_0: 0..15), for unpacking and the portable
// tile.
template <Format F>
inline int32_t block_value(const uint8_t* q, int c, int kk) {
  const int g = kk / 4, i = kk % 4;
  if constexpr (F == Q8_0) return ((const int8_t*)q)[g * 64 + c * 4 + i];
  const uint8_t byte = q[g * 32 + (c % 8) * 4 + i];
  return c < 8 ? byte & 15 : byte >> 4;
}

}  // namespace tmk
