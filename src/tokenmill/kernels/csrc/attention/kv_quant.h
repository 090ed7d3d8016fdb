// The quantized KV cache (`--kv-cache-dtype int8|fp8`): each (slot, KV head) row of Dh values is held as Dh bytes
// and one bfloat16 scale, as llama.cpp's q8_0 KV holds blocks of 32 (here the block is one head's row: 64 or 128
// values, so a row costs Dh + 2 bytes where bf16 costs 2 Dh). int8 rows are x / scale rounded to integers, scale
// about absmax / 127; fp8 rows are x / scale as float8 e4m3 (4 exponent bits, 3 mantissa bits, largest 448), scale
// about absmax / 448. A layer's scales lie in their own plane [2, slots, Hkv] beside its rows [2, slots, Hkv, Dh].
// Rows are quantized as they are written and widened to float32 a run at a time where attention reads them: the
// cache is never dequantized whole.
//
// The scale is float32 absmax / 127 (448) rounded up to a power of two, held as a bfloat16 (exact; bf16's 8-bit
// exponent: no row is too small for its scale; rounded up: no value passes the largest code); each value is
// x * (1 / scale) rounded to nearest even; a row of zeros has scale 0 and zeros. A power of two makes every widened
// value (an integer of at most 7 bits, or an e4m3, times 2^e) exact in bfloat16: a bf16 model's paths read the
// same values without rounding them, and a scale multiplies a dot product or a weight as exactly as each value.
// The pure-torch reference (attention/kv_quant.py) writes the same bytes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/simd.h"

namespace tmk {

// one float8 e4m3 value (its bits): the fp8 cache's element type
struct f8e4m3 {
  uint8_t bits;
};

template <typename C>
constexpr bool kv_quantized = std::is_same_v<C, int8_t> || std::is_same_v<C, f8e4m3>;

// a positive float -> the smallest power of two at or above it, as a bfloat16 (its bits); 0 -> 0
inline uint16_t pow2_at_or_above(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (x == 0) return 0;
  return (uint16_t)(((x >> 23) + ((x & 0x7fffff) != 0)) << 7);
}

// a float of magnitude <= 448 -> float8 e4m3, rounded to nearest even (as torch's .to(torch.float8_e4m3fn))
inline uint8_t float_to_e4m3(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint8_t sign = (uint8_t)((x >> 24) & 0x80);
  float a = std::min(std::fabs(f), 448.f);
  std::memcpy(&x, &a, 4);
  if (x < 0x3c800000) return sign | (uint8_t)std::nearbyint(a * 512.f);  // below 2^-6: subnormal, units of 2^-9
  uint32_t h = (x - (120u << 23)) >> 20;  // exponent rebiased (127 -> 7), mantissa cut to 3 bits
  const uint32_t rest = x & 0xfffff;
  if (rest > 0x80000 || (rest == 0x80000 && (h & 1))) ++h;  // a carry into the exponent is right too
  return sign | (uint8_t)h;
}

// W float8 e4m3 values -> W floats: the bits moved into a float's places (sign; exponent and mantissa 7 bits
// under the float's), then scaled by 2^(127 - 7); e4m3's subnormals become float subnormals, which the product makes
// exact again
inline vf load_e4m3(const f8e4m3* p) {
  const vu b = load_u8((const uint8_t*)p);
  const vu bits = ((b & 0x80u) << 24) | ((b & 0x7fu) << 20);
  vf f;
  std::memcpy(&f, &bits, sizeof(f));
  return f * splat(0x1p120f);
}

inline float e4m3_to_float(uint8_t b) {
  const uint32_t bits = ((uint32_t)(b & 0x80) << 24) | ((uint32_t)(b & 0x7f) << 20);
  float f;
  std::memcpy(&f, &bits, 4);
  return f * 0x1p120f;
}

// one row of n values (bf16 as uint16_t, or float) -> n int8 or e4m3 values and their bf16 scale
template <typename C, typename T>
inline void quantize_kv_row(const T* x, int64_t n, C* q, uint16_t* scale) {
  auto value = [&](int64_t d) {
    if constexpr (sizeof(T) == 2) return bf16_to_float(*(const uint16_t*)(x + d));
    else return (float)x[d];
  };
  constexpr float top = std::is_same_v<C, int8_t> ? 127.f : 448.f;
  float amax = 0.f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(value(d)));
  const uint16_t h = pow2_at_or_above(amax / top);
  const float s = bf16_to_float(h), inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t d = 0; d < n; ++d) {
    if constexpr (std::is_same_v<C, int8_t>) q[d] = (int8_t)std::clamp(std::nearbyint(value(d) * inv), -127.f, 127.f);
    else q[d].bits = float_to_e4m3(value(d) * inv);
  }
  *scale = h;
}

// k, v [T, Hkv * Dh] (rows k_stride, v_stride apart) -> a layer's quantized cache [2, slots, Hkv, Dh] and its
// scales [2, slots, Hkv] at slot[t]
template <typename C, typename T>
inline void kv_write_rows_quant(const T* k, int64_t k_stride, const T* v, int64_t v_stride, C* cache,
                                uint16_t* scales, int64_t slots, const int64_t* slot, int64_t n, int64_t Hkv,
                                int64_t Dh) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t key = slot[t] * Hkv + g, value = (slots + slot[t]) * Hkv + g;
      quantize_kv_row(k + t * k_stride + g * Dh, Dh, cache + key * Dh, scales + key);
      quantize_kv_row(v + t * v_stride + g * Dh, Dh, cache + value * Dh, scales + value);
    }
}

// W codes of a quantized row widened to float32, their scale not applied (int8 or float8 e4m3)
template <typename C>
inline vf load_codes(const C* p) {
  if constexpr (std::is_same_v<C, int8_t>) return load_i8(p);
  else return load_e4m3(p);
}
template <typename C>
inline float code_to_float(C c) {
  if constexpr (std::is_same_v<C, int8_t>) return (float)c;
  else return e4m3_to_float(c.bits);
}

// m quantized rows of Dh (src, `stride` elements apart; their scales sc, `sc_stride` apart) -> float32 rows in
// buf [m, Dh]; with sc null, the codes alone (each row's scale, a power of two, then multiplies what the row's
// values made: a dot product, a weight, as exactly as it would each value)
template <typename C>
inline const float* widen_quant_rows(const C* src, int64_t stride, const uint16_t* sc, int64_t sc_stride, int64_t m,
                                     int64_t Dh, float* buf) {
  for (int64_t i = 0; i < m; ++i) {
    const float s = sc ? bf16_to_float(sc[i * sc_stride]) : 1.f;
    const C* row = src + i * stride;
    float* dst = buf + i * Dh;
    int64_t d = 0;
    if (sc)
      for (; d + W <= Dh; d += W) store(dst + d, load_codes(row + d) * splat(s));
    else
      for (; d + W <= Dh; d += W) store(dst + d, load_codes(row + d));
    for (; d < Dh; ++d) dst[d] = code_to_float(row[d]) * s;
  }
  return buf;
}

}  // namespace tmk
