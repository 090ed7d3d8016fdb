// The activation quantizer's block step in portable C++ (the scalar variant). linear/qrow.h picks this file.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "linear/format.h"

namespace tmk {

// One block of 32 activations: max |x|
inline float block_amax(const float* xb) {
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
  return amax;
}

// One block of 32 activations -> q[0..32) int8 at the scale d = amax / 127 (amax: the block's, or its group's):
// q = x / d rounded to nearest, ties to even (as ggml's AVX2 quantize_row_q8_0). Returns the block's sum of q.
inline int32_t quantize_block(const float* xb, int8_t* q, float d) {
  const float id = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < QK; ++i) {
    const int32_t v = (int32_t)std::nearbyint(xb[i] * id);  // |v| <= 127; ties to even in the default mode
    q[i] = (int8_t)v;
    sum += v;
  }
  return sum;
}

}  // namespace tmk
