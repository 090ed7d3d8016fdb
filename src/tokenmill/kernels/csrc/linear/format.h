// The packed weight formats (kernels/formats.py packs them; the ids are its FORMATS) and their layouts: every format
// keeps P=16 output channels per panel, panels back to back, and a panel is K / block_k blocks of block_bytes.
//   bf16:  panel = [K/2][P][2] bfloat16: k in pairs, so one load gives W channels at k and k + 1 as 32-bit lanes,
//          and a bf16 becomes a float with one shift (k) or one mask (k + 1); K is even (padded)
//   f32:   panel = [K][P] float32
//   Q8_0:  K/32 blocks of { fp16 d[16]; int8  q[8][16][4] }  q[g][c][i] = w[c][4g + i];  w = d * q
//   Q4_0:  K/32 blocks of { fp16 d[16]; uint8 q[8][8][4] }   q[g][c][i] = w[c][4g + i] | w[c + 8][4g + i] << 4
//          (w in 0..15, the weight is d * (w - 8))
// The dense formats keep a panel's weights k-major (for each k, the P channels side by side), so one vector load
// gives W channels at one k; the quantized ones group 4 k per channel for 8-bit integer dot products (linear/quant.h).
// Which kernels multiply each format: linear/type_traits.h.
#pragma once

#include <cstdint>

#include "core/vec.h"

namespace tmk {

enum Format { BF16 = 0, Q8_0 = 1, Q4_0 = 2, F32 = 3 };
constexpr int QK = 32;  // weights per quantization block

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
