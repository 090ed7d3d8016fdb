// Portable SIMD for the kernels over the vector types of core/vec.h: loads, stores, bf16 and half conversions,
// the exponentials of softmax and SiLU. The few operations that want the ISA's own instructions (splat, the
// widening bf16 load, horizontal sums, lane tests) come from the build's arch/<variant>/simd.h.
#pragma once

#include <cstdint>
#include <cstring>

#include "arch/isa.h"
#include "core/vec.h"

#if TM_SIMD_AVX512
#include "arch/avx512/simd.h"
#elif TM_SIMD_AVX2
#include "arch/avx2/simd.h"
#else
#include "arch/generic/simd.h"
#endif

namespace tmk {

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// 2W bfloat16 values holding W pairs (a, b) side by side -> the a's (`odd` false) or the b's as floats: each pair
// is one 32-bit lane (a in its low half), and a bf16 is the top half of a float's bits: a = lane << 16, b = lane &
// high.
inline vf load_bf16_half(const uint16_t* p, bool odd) {
  vu lanes;
  std::memcpy(&lanes, p, sizeof(lanes));
  lanes = odd ? lanes & 0xffff0000u : lanes << 16;
  vf f;
  std::memcpy(&f, &lanes, sizeof(f));
  return f;
}

// load_bf16_half for a tile that needs every register: the odd half's mask read from memory by the and itself
// (arch/avx2/simd.h), where holding it in a register pushed one of the tile's sums onto the stack. Elsewhere (a
// 1-row tile: 5% slower on the Xeon's avx2 variant) the mask stays in a register.
inline vf load_bf16_half_tight(const uint16_t* p, bool odd) {
#if TM_SIMD_AVX2
  if (odd) {
    vu lanes;
    std::memcpy(&lanes, p, sizeof(lanes));
    return bf16_high(lanes);
  }
#endif
  return load_bf16_half(p, odd);
}

// Both halves at once (the two loads are one).
inline void load_bf16_pair(const uint16_t* p, vf& a, vf& b) {
  a = load_bf16_half(p, false);
  b = load_bf16_half(p, true);
}

// 2^f for f in [-0.5, 0.5]: a degree-6 polynomial, ~1 ulp
inline vf exp2_fraction(vf f) {
  vf p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.f);
  return p;
}

// e^x for x <= 0 (softmax's shifted scores), ~1 ulp: 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5]. Below -87 it
// stays at e^-87 (~1.7e-38, where e^x would go subnormal, then 0): nothing a softmax's sum can see.
inline vf exp_neg(vf x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  vf t = x * splat(1.44269504088896341f);
  vf n = __builtin_convertvector(__builtin_convertvector(t + (t < splat(0.f) ? splat(-0.5f) : splat(0.5f)), vi), vf);
  const vf p = exp2_fraction(t - n);  // 2^f, f in [-0.5, 0.5]
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// e^x for any x, as exp_neg but n rounded by adding 1.5 * 2^23 (whose float has n in its low bits; no conversions)
// and 2^n built from those bits: a sigmoid's e^-g. Above ~88.7 it overflows to inf, as std::exp does; below -87 it
// stays at ~e^-87 (1 + e^x does not see the difference).
inline vf exp_any(vf x) {
  constexpr float SHIFT = 12582912.f;  // 1.5 * 2^23
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.8f) ? splat(88.8f) : x;
  const vf t = x * splat(1.44269504088896341f);
  const vf shifted = t + splat(SHIFT);  // bits: SHIFT's, plus n in the mantissa
  const vf p = exp2_fraction(t - (shifted - splat(SHIFT)));  // 2^f, f in [-0.5, 0.5]
  vu bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits << 23) + (127u << 23);  // SHIFT's own bits shift out: (n + 127) << 23, 2^n (n = 128: inf)
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 2^t for t <= 0 (a softmax's shifted scores in log2 units), ~1 ulp: exp_any's rounding and 2^n from the bits
// (no conversions), clamped at -126 (2^-126, ~1.2e-38: nothing a softmax's sum can see); with the shift and log2 e
// in one FMA before it, 12 instructions where exp_neg of a difference takes 17
inline vf exp2_neg(vf t) {
  constexpr float SHIFT = 12582912.f;  // 1.5 * 2^23
  t = t < splat(-126.f) ? splat(-126.f) : t;
  const vf shifted = t + splat(SHIFT);
  const vf p = exp2_fraction(t - (shifted - splat(SHIFT)));  // 2^f, f in [-0.5, 0.5]
  vu bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits << 23) + (127u << 23);  // (n + 127) << 23: 2^n
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// IEEE half -> float, for the per-block scales of Q8_0 / Q4_0 (read once per block, scalar is fine).
inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// bfloat16 -> float: a bf16 is the top half of a float's bits
inline float bf16_to_float(uint16_t h) {
  const uint32_t x = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// float -> bfloat16 with round-to-nearest-even (NaN stays NaN), as torch rounds.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}

// W floats rounded to bfloat16 as float_to_bf16 rounds (nearest even; a NaN stays a NaN), kept as floats. Without
// NaNs (one compare and a branch) the rounding alone: half the instructions (SiLU's two roundings per value)
inline vf bf16_rounded(vf f) {
  vu bits;
  std::memcpy(&bits, &f, sizeof(bits));
  vu r = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;  // nearest even
  if (any_nan(f)) {
    const vu nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where a NaN
    const vu quiet = (bits | 0x400000u) & 0xffff0000u;
    r = (nan & quiet) | (~nan & r);
  }
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// W floats stored as bfloat16 at p, each as float_to_bf16 rounds it
inline void store_bf16(uint16_t* p, vf f) {
  const vf r = bf16_rounded(f);
  vu bits;
  std::memcpy(&bits, &r, sizeof(bits));
  const vu16 top = __builtin_convertvector(bits >> 16, vu16);
  std::memcpy(p, &top, sizeof(top));
}

}  // namespace tmk
