// A packed panel back as float32 (kernels.cpp's unpack: the prefill path multiplies it with torch's own GEMM).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/simd.h"
#include "linear/format.h"

namespace tmk {

// The panel's n_valid channels -> out[i * K + k] for every k < K.
template <Format F>
void unpack_panel(const uint8_t* panel, int64_t K, int64_t n_valid, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    float vals[P];
    if constexpr (F == F32) {
      std::memcpy(vals, (const float*)panel + k * P, sizeof(vals));
    } else if constexpr (F == BF16) {
      for (int i = 0; i < P; ++i) {  // k pairs: [K/2][P][2]
        uint32_t bits = (uint32_t)((const uint16_t*)panel)[(k / 2) * 2 * P + 2 * i + k % 2] << 16;
        std::memcpy(&vals[i], &bits, 4);
      }
    } else {
      const uint8_t* blk = panel + (k / QK) * quant_block_bytes(F);
      const int kk = k % QK;
      for (int i = 0; i < P; ++i) {
        const float d = half_to_float(((const uint16_t*)blk)[i]);
        if constexpr (F == Q8_0) vals[i] = d * (float)block_value<Q8_0>(blk + 2 * P, i, kk);
        else vals[i] = d * (float)(block_value<Q4_0>(blk + 2 * P, i, kk) - 8);
      }
    }
    for (int64_t i = 0; i < n_valid; ++i) out[i * K + k] = vals[i];
  }
}

}  // namespace tmk
