// The decode step's small ops, fused so a layer is a handful of calls instead of dozens of torch ops.
//
// Activations are bfloat16 or float32 (`bf16`), like the model. Each op computes in float32 and rounds where
// the torch code it replaces rounds (a bf16 tensor op rounds its result), so the two paths agree to the last
// bit almost always (summation order aside).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/simd.h"

namespace tmk {

struct Act {  // a row-major activation buffer of either dtype
  void* ptr;
  bool bf16;
  inline float get(int64_t i) const {
    return bf16 ? bf16_to_float(((const uint16_t*)ptr)[i]) : ((const float*)ptr)[i];
  }
  inline void set(int64_t i, float f) const {
    if (bf16) ((uint16_t*)ptr)[i] = float_to_bf16(f);
    else ((float*)ptr)[i] = f;
  }
  // what storing f in this dtype keeps
  inline float round(float f) const {
    if (!bf16) return f;
    uint32_t bits = (uint32_t)float_to_bf16(f) << 16;
    float r;
    std::memcpy(&r, &bits, 4);
    return r;
  }
  // the same, W lanes from i at a time
  inline vf getv(int64_t i) const { return bf16 ? load_bf16((const uint16_t*)ptr + i) : load((const float*)ptr + i); }
  inline vf roundv(vf f) const { return bf16 ? bf16_rounded(f) : f; }
  inline void setv(int64_t i, vf f) const {
    if (!bf16) return store((float*)ptr + i, f);
    store_bf16((uint16_t*)ptr + i, f);
  }
};

// residual (optional, [rows, D]) += x; out = rmsnorm(residual or x) * weight. HF's order: the sum rounded to the
// dtype, the normalized value rounded, then multiplied by the weight and rounded.
inline void rmsnorm_rows(Act x, Act residual, bool has_residual, Act weight, float eps, Act out, int64_t rows,
                         int64_t D) {
  typedef double vd __attribute__((vector_size(W * 8)));
  thread_local std::vector<float> h;
  h.resize(D);
  const int64_t Dv = D - D % W;
  for (int64_t r = 0; r < rows; ++r) {
    // the squares summed in double, W lanes at a time: the same float rs as one double sum but in the rarest ties
    vd sv = {};
    for (int64_t i = 0; i < Dv; i += W) {
      vf v = x.getv(r * D + i);
      if (has_residual) {
        v = residual.roundv(v + residual.getv(r * D + i));
        residual.setv(r * D + i, v);
      }
      store(h.data() + i, v);
      const vd w = __builtin_convertvector(v, vd);
      sv += w * w;
    }
    double ss = 0.0;
    for (int i = 0; i < W; ++i) ss += sv[i];
    for (int64_t i = Dv; i < D; ++i) {
      float v = x.get(r * D + i);
      if (has_residual) {
        v = residual.round(v + residual.get(r * D + i));
        residual.set(r * D + i, v);
      }
      h[i] = v;
      ss += (double)v * v;
    }
    const float rs = 1.0f / std::sqrt((float)(ss / D) + eps);
    for (int64_t i = 0; i < Dv; i += W)
      out.setv(r * D + i, weight.getv(i) * out.roundv(load(h.data() + i) * splat(rs)));
    for (int64_t i = Dv; i < D; ++i) out.set(r * D + i, out.round(weight.get(i) * out.round(h[i] * rs)));
  }
}

// x [T, heads, Dh] in place: rotate-half RoPE with cos/sin [T, Dh] (both in x's dtype), as HF: x * cos and
// rotate_half(x) * sin each rounded, then their sum.
inline void rope_rows(Act x, Act cos, Act sin, int64_t T, int64_t heads, int64_t Dh, int64_t row_stride) {
  const int64_t half = Dh / 2, lanes = half - half % W;  // [0, lanes) W at a time, the rest one by one
  for (int64_t t = 0; t < T; ++t) {
    const int64_t c = t * Dh;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = t * row_stride + h * Dh;
      // x[i] and x[i + half] are both read before either is written: in place is safe
      for (int64_t i = 0; i < lanes; i += W) {
        const vf lo = x.getv(base + i), hi = x.getv(base + half + i);
        x.setv(base + i, x.roundv(lo * cos.getv(c + i)) + x.roundv(-hi * sin.getv(c + i)));
        x.setv(base + half + i, x.roundv(hi * cos.getv(c + half + i)) + x.roundv(lo * sin.getv(c + half + i)));
      }
      for (int64_t i = lanes; i < half; ++i) {
        const float lo = x.get(base + i), hi = x.get(base + half + i);
        x.set(base + i, x.round(lo * cos.get(c + i)) + x.round(-hi * sin.get(c + i)));
        x.set(base + half + i, x.round(hi * cos.get(c + half + i)) + x.round(lo * sin.get(c + half + i)));
      }
    }
  }
}

// out [rows, I] = silu(gate) * up, from gate_up [rows, 2I] (gate first): silu rounded, then the product.
// silu(g) = g / (1 + e^-g), as torch computes it, W lanes at a time with exp_any (e^-g is inf for g below ~-88.7:
// -0, as torch); std::exp per element was a visible share of a decode step. (exp_neg on -|g| with a select per sign,
// and bf16 roundings that always handled NaNs, ran at half the speed.)
// With `cols` >= 0, only the first `cols` of each row's I values (a part of the row: the pointers start at it).
inline void silu_mul_rows(Act gate_up, Act out, int64_t rows, int64_t I, int64_t cols = -1) {
  if (cols < 0) cols = I;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t gate = r * 2 * I, up = gate + I;
    for (int64_t i = 0; i < cols; i += W) {
      const int64_t n = std::min<int64_t>(W, cols - i);
      vf g = {};
      if (n == W) g = gate_up.getv(gate + i);
      else for (int64_t j = 0; j < n; ++j) g[j] = gate_up.get(gate + i + j);
      const vf silu = g / (splat(1.f) + exp_any(-g));
      if (n == W) out.setv(r * I + i, out.roundv(silu) * gate_up.getv(up + i));
      else for (int64_t j = 0; j < n; ++j) out.set(r * I + i + j, out.round(silu[j]) * gate_up.get(up + i + j));
    }
  }
}

// gpt-oss's clamped SwiGLU over rows of [gate | up] (I each): gate = min(gate, limit), up = clamp(up, -limit,
// limit), out = (up + 1) * (gate * sigmoid(gate * alpha)), each op's result rounded to the dtype as torch's ops store
// it (models/gpt_oss.py: ClampedSwiGLU). A NaN stays NaN, as torch's clamp keeps it.
inline void clamped_swiglu_rows(Act gate_up, Act out, int64_t rows, int64_t I, float alpha, float limit) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      float g = gate_up.get(r * 2 * I + i), u = gate_up.get(r * 2 * I + I + i);
      g = g > limit ? limit : g;
      u = u > limit ? limit : (u < -limit ? -limit : u);
      const float sig = out.round(1.f / (1.f + std::exp(-out.round(g * alpha))));
      out.set(r * I + i, out.round(u + 1.f) * out.round(g * sig));
    }
}

// The index of the largest of x[0..n) (float32), as torch.argmax: the first of equal maxima; the first NaN where
// there is one. Lane by lane, then across lanes (torch's reduction was a visible share of a decode step).
inline int64_t argmax_row(const float* x, int64_t n) {
  if (n < W) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; ++i)
      if (x[i] != x[i]) return i;
      else if (x[i] > x[best]) best = i;
    return best;
  }
  vf top = load(x), nan = top != top ? splat(1.f) : splat(0.f);
  vi at, lane;
  for (int i = 0; i < W; ++i) at[i] = lane[i] = i;
  int64_t i = W;
  for (; i + W <= n; i += W) {
    const vf v = load(x + i);
    const vi higher = v > top;
    top = higher ? v : top;
    at = higher ? lane + (int32_t)i : at;
    nan = v != v ? splat(1.f) : nan;
  }
  for (int j = 0; j < W; ++j)
    if (nan[j] != 0.f)
      for (int64_t k = 0; k < n; ++k)
        if (x[k] != x[k]) return k;
  int64_t best = at[0];
  for (int j = 1; j < W; ++j)
    if (top[j] > x[best] || (top[j] == x[best] && at[j] < best)) best = at[j];
  for (; i < n; ++i)
    if (x[i] != x[i]) return i;
    else if (x[i] > x[best]) best = i;
  return best;
}

// k, v [T, Hkv * Dh] (rows of strides k_stride, v_stride) -> cache [2, slots, Hkv * Dh] at slots[t]
template <typename T>
inline void kv_write_rows(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* cache, int64_t slots,
                          const int64_t* slot, int64_t n, int64_t width) {
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(cache + slot[t] * width, k + t * k_stride, width * sizeof(T));
    std::memcpy(cache + (slots + slot[t]) * width, v + t * v_stride, width * sizeof(T));
  }
}

}  // namespace tmk
