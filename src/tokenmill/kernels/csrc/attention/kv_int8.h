// The int8 KV cache (`--kv-cache-dtype int8`): each (slot, KV head) row of Dh values is held as Dh int8 and one
// bfloat16 scale, absmax / 127, as llama.cpp's q8_0 KV holds blocks of 32 (here the block is one head's row: 64 or
// 128 values, so a row costs Dh + 2 bytes where bf16 costs 2 Dh). A layer's scales lie in their own plane
// [2, slots, Hkv] beside its values [2, slots, Hkv, Dh]. Rows are quantized as they are written and widened to
// float32 a run at a time where attention reads them: the cache is never dequantized whole.
//
// The pure-torch reference (attention/kv_quant.py) writes the same bytes: the scale is float32 absmax / 127 rounded
// up to a bfloat16 (bf16's 8-bit exponent: no row is too small for its scale, as with a half's), each value
// x * (1 / scale) rounded to nearest even (never past 127); a row of zeros has scale 0 and zeros.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/simd.h"

namespace tmk {

// a positive float -> the smallest bfloat16 at or above it (its bits): a row's scale rounded up, so that no value
// quantizes past 127
inline uint16_t bf16_at_or_above(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return (uint16_t)((x >> 16) + ((x & 0xffff) != 0));
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t x = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// one row of n values (bf16 as uint16_t, or float) -> n int8 and its bf16 scale
template <typename T>
inline void quantize_kv_row(const T* x, int64_t n, int8_t* q, uint16_t* scale) {
  auto value = [&](int64_t d) {
    if constexpr (sizeof(T) == 2) {
      const uint32_t bits = (uint32_t)*(const uint16_t*)(x + d) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    } else {
      return (float)x[d];
    }
  };
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(value(d)));
  const uint16_t h = bf16_at_or_above(amax / 127.f);
  const float s = bf16_to_float(h), inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t d = 0; d < n; ++d) q[d] = (int8_t)std::clamp(std::nearbyint(value(d) * inv), -127.f, 127.f);
  *scale = h;
}

// k, v [T, Hkv * Dh] (rows k_stride, v_stride apart) -> a layer's int8 cache [2, slots, Hkv, Dh] and its scales
// [2, slots, Hkv] at slot[t]
template <typename T>
inline void kv_write_rows_int8(const T* k, int64_t k_stride, const T* v, int64_t v_stride, int8_t* cache,
                               uint16_t* scales, int64_t slots, const int64_t* slot, int64_t n, int64_t Hkv,
                               int64_t Dh) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t key = slot[t] * Hkv + g, value = (slots + slot[t]) * Hkv + g;
      quantize_kv_row(k + t * k_stride + g * Dh, Dh, cache + key * Dh, scales + key);
      quantize_kv_row(v + t * v_stride + g * Dh, Dh, cache + value * Dh, scales + value);
    }
}

// m int8 rows of Dh (src, `stride` elements apart; their scales sc, `sc_stride` apart) -> float32 rows in buf [m, Dh]
inline const float* widen_int8_rows(const int8_t* src, int64_t stride, const uint16_t* sc, int64_t sc_stride,
                                    int64_t m, int64_t Dh, float* buf) {
  for (int64_t i = 0; i < m; ++i) {
    const float s = bf16_to_float(sc[i * sc_stride]);
    const int8_t* row = src + i * stride;
    float* dst = buf + i * Dh;
    int64_t d = 0;
    for (; d + W <= Dh; d += W) store(dst + d, load_i8(row + d) * splat(s));
    for (; d < Dh; ++d) dst[d] = (float)row[d] * s;
  }
  return buf;
}

// n floats rounded to bfloat16 in place (kept as floats)
inline void round_rows_bf16(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(x + i, bf16_rounded(load(x + i)));
  for (; i < n; ++i) x[i] = bf16_to_float(float_to_bf16(x[i]));
}

}  // namespace tmk
