// The quantized formats' register tile in portable C++ (the scalar variant): the same exact integer sums as the
// x86 tiles, in plain loops, scaled the same way. linear/qpanel.h picks this file.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/simd.h"
#include "linear/format.h"
#include "linear/qrow.h"

namespace tmk {

template <Format F, int MT>
inline void qtile(const uint8_t* panel, const QRow* x, int64_t b0, int64_t b1, float (*sums)[P], bool) {
  if (b0 == 0)
    for (int m = 0; m < MT; ++m) std::fill(sums[m], sums[m] + P, 0.f);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = panel + b * quant_block_bytes(F);
    float dw[P];
    for (int c = 0; c < P; ++c) dw[c] = half_to_float(((const uint16_t*)blk)[c]);
    for (int m = 0; m < MT; ++m) {
      int32_t isum[P] = {};
      for (int kk = 0; kk < QK; ++kk) {
        const int32_t xq = x[m].q[b * QK + kk];
        for (int c = 0; c < P; ++c) isum[c] += block_value<F>(blk + 2 * P, c, kk) * xq;
      }
      for (int c = 0; c < P; ++c) {
        if constexpr (F == Q4_0) isum[c] += x[m].o[2 * b];
        sums[m][c] += (float)isum[c] * (dw[c] * x[m].d[b]);
      }
    }
  }
}

}  // namespace tmk
