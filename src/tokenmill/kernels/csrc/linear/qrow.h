// Quantized activation rows: each row is quantized once per call to Q8_0 blocks (32 int8 values and one float
// scale per block), the quantized formats' integer tiles' input (linear/quant.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "arch/isa.h"
#include "linear/format.h"

#if defined(__AVX2__)
#include "arch/avx2/quantize.h"
#else
#include "arch/generic/quantize.h"
#endif

namespace tmk {

// A quantized activation row, in place of K floats: float d[nb], int32 o[nb][2] = {-8 s, -128 s} where s is the
// block's sum of q (Q4_0's offsets: its tiles start a block's integer sums there, o[b][1] for the high nibbles kept
// in place, 16 times their weight), int32 s[nb][2] = the sums of q over each half block (k 0-15, 16-31: the K family's
// sub-blocks, linear/kformat.h), float fs[nb][3] = the same two sums and the whole block's, as floats (exact: the
// 16-lane K tiles broadcast them from memory instead of converting), int8 q[K], and with VNNI, for Q8_0 weights,
// uint8 u[K] = q + 128 (the unsigned side of vpdpbusd). 8 nb + K / 2 floats in all. qrow() is the one place that
// knows the layout.
struct QRow {
  const float* d;
  const int32_t* o;
  const int32_t* s;
  const float* fs;
  const int8_t* q;
  const uint8_t* u;
};

inline QRow qrow(const float* row, int64_t nb) {
  const int8_t* q = (const int8_t*)(row + 8 * nb);
  return {row, (const int32_t*)(row + nb), (const int32_t*)(row + 3 * nb), row + 5 * nb, q,
          (const uint8_t*)q + nb * QK};
}

// x[0..K) float32 -> the QRow layout at `dst` (which has room for K floats): per group of `group` k (32, or 256 for
// the K-quants' superblocks, as ggml's Q8_K), d = max|x| / 127, kept in float32 in each of the group's blocks, and
// q = x / d rounded to nearest, ties to even (as ggml's AVX2 quantize_row_q8_0); with `for_q8_0` and VNNI also
// u = q + 128. Only the blocks [b0, b1) where b1 >= 0 (the row in parts, by threads: whole groups).
inline void quantize_row(const float* x, int64_t K, float* dst, bool for_q8_0 = false, int64_t b0 = 0,
                         int64_t b1 = -1, int64_t group = QK) {
  const int64_t nb = K / QK, per = group / QK;
  if (b1 < 0) b1 = nb;
  const QRow row = qrow(dst, nb);
  int32_t* o = (int32_t*)row.o;
  int32_t* halves = (int32_t*)row.s;
  float* fs = (float*)row.fs;
  int8_t* q = (int8_t*)row.q;
  float d = 0.f;
  for (int64_t b = b0; b < b1; ++b) {
    if ((b - b0) % per == 0) {
      float amax = 0.f;
      for (int64_t i = b; i < std::min(b + per, b1); ++i) amax = std::max(amax, block_amax(x + i * QK));
      d = amax / 127.f;
    }
    const int32_t sum = quantize_block(x + b * QK, q + b * QK, d);
    dst[b] = d;
    o[2 * b] = -8 * sum, o[2 * b + 1] = -128 * sum;
    int32_t first = 0;
    for (int k = 0; k < QK / 2; ++k) first += q[b * QK + k];
    halves[2 * b] = first, halves[2 * b + 1] = sum - first;
    fs[3 * b] = (float)first, fs[3 * b + 1] = (float)(sum - first), fs[3 * b + 2] = (float)sum;
  }
  if constexpr (TM_VNNI) {
    uint8_t* u = (uint8_t*)row.u;
    for (int64_t k = b0 * QK; for_q8_0 && k < b1 * QK; ++k) u[k] = (uint8_t)q[k] ^ 0x80;
  } else {
    (void)for_q8_0;
  }
}

}  // namespace tmk
