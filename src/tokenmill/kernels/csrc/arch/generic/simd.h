// The vector layer's ISA-specific operations in portable vector code: the scalar variant's, and any build whose
// lane count has no instructions here (the test-only 16-lane build with AVX2 flags). core/simd.h picks this file.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/vec.h"

namespace tmk {

inline vf splat(float x) {
  vf v;
  for (int i = 0; i < W; ++i) v[i] = x;
  return v;
}

// W bfloat16 values -> W floats: a bf16 is the top half of a float's bits.
inline vf load_bf16(const uint16_t* p) {
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  vu bits = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// W int8 values -> W floats (the int8 KV cache's rows)
inline vf load_i8(const int8_t* p) {
  vf f;
  for (int i = 0; i < W; ++i) f[i] = (float)p[i];
  return f;
}

// W bytes -> W 32-bit lanes (the fp8 KV cache's rows)
inline vu load_u8(const uint8_t* p) {
  vu u;
  for (int i = 0; i < W; ++i) u[i] = p[i];
  return u;
}

// the sum of v's lanes
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// the largest of v's lanes (none a NaN)
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// {hsum(a), hsum(b), hsum(c), hsum(d)} -> out[0..4)
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
}

// whether any lane of v is a NaN
inline bool any_nan(vf v) {
  for (int i = 0; i < W; ++i)
    if (v[i] != v[i]) return true;
  return false;
}

// whether any lane of a comparison's mask is set
inline bool any_lane(vi mask) {
  bool any = false;
  for (int j = 0; j < W; ++j) any |= mask[j] != 0;
  return any;
}

}  // namespace tmk
