// The decode step's small ops, fused so a layer is a handful of calls instead of dozens of torch ops.
//
// Activations are bfloat16 or float32 (`bf16`), like the model. Each op computes in float32 and rounds where
// the torch code it replaces rounds (a bf16 tensor op rounds its result), so the two paths agree to the last
// bit almost always (summation order aside).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace tmk {

struct Act {  // a row-major activation buffer of either dtype
  void* ptr;
  bool bf16;
  inline float get(int64_t i) const {
    if (!bf16) return ((const float*)ptr)[i];
    uint32_t bits = (uint32_t)((const uint16_t*)ptr)[i] << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
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
    vf r = bf16_rounded(f);
    vu bits;
    std::memcpy(&bits, &r, sizeof(bits));
    const vu16 top = __builtin_convertvector(bits >> 16, vu16);
    std::memcpy((uint16_t*)ptr + i, &top, sizeof(top));
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
  const int64_t half = Dh / 2;
  std::vector<float> v(Dh);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = t * row_stride + h * Dh;
      for (int64_t i = 0; i < Dh; ++i) v[i] = x.get(base + i);
      for (int64_t i = 0; i < Dh; ++i) {
        const float rot = i < half ? -v[i + half] : v[i - half];
        const float a = x.round(v[i] * cos.get(t * Dh + i)), b = x.round(rot * sin.get(t * Dh + i));
        x.set(base + i, a + b);
      }
    }
  }
}

// out [rows, I] = silu(gate) * up, from gate_up [rows, 2I] (gate first): silu rounded, then the product.
// silu(g) = g / (1 + e^-g), W lanes at a time with exp_neg on -|g| (g < 0: g e^g / (1 + e^g)); std::exp per
// element cost a 16-row decode step on the Xeon ~9% of its time.
inline void silu_mul_rows(Act gate_up, Act out, int64_t rows, int64_t I) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t gate = r * 2 * I, up = gate + I;
    for (int64_t i = 0; i < I; i += W) {
      const int64_t n = std::min<int64_t>(W, I - i);
      vf g = {};
      if (n == W) g = gate_up.getv(gate + i);
      else for (int64_t j = 0; j < n; ++j) g[j] = gate_up.get(gate + i + j);
      const vf negative = g < splat(0.f) ? splat(1.f) : splat(0.f);
      const vf e = exp_neg(negative > splat(0.f) ? g : -g);  // e^-|g|
      const vf silu = (negative > splat(0.f) ? g * e : g) / (splat(1.f) + e);
      if (n == W) out.setv(r * I + i, out.roundv(silu) * gate_up.getv(up + i));
      else for (int64_t j = 0; j < n; ++j) out.set(r * I + i + j, out.round(silu[j]) * gate_up.get(up + i + j));
    }
  }
}

// W lanes of a row of T (bfloat16 as uint16_t, or float) as floats
template <typename T>
inline vf load_row(const T* p) {
  if constexpr (sizeof(T) == 2) return load_bf16((const uint16_t*)p);
  else return load((const float*)p);
}

template <typename T>
inline float load_one(const T* p) {
  if constexpr (sizeof(T) == 2) {
    uint32_t bits = (uint32_t)*(const uint16_t*)p << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return *(const float*)p;
  }
}

// dot(a[0..Dh), row[0..Dh)) with a in float32 and the row in T
template <typename T>
inline float dot_row(const float* a, const T* row, int64_t Dh) {
  vf s = {};
  int64_t i = 0;
  for (; i + W <= Dh; i += W) s += load(a + i) * load_row(row + i);
  float r = hsum(s);
  for (; i < Dh; ++i) r += a[i] * load_one(row + i);
  return r;
}

// out[i] = dot(a[0..Dh), rows[i * stride ..]) for i < n (float32 rows): four rows at a time share a's loads and
// one shuffle tree for their sums
inline void dot_rows(const float* a, const float* rows, int64_t stride, int64_t n, int64_t Dh, float* out) {
  int64_t i = 0;
  if (Dh % W == 0)
    for (; i + 4 <= n; i += 4) {
      vf s[4] = {};
      for (int64_t d = 0; d < Dh; d += W) {
        const vf av = load(a + d);
        for (int r = 0; r < 4; ++r) s[r] += av * load(rows + (i + r) * stride + d);
      }
      hsum4(s[0], s[1], s[2], s[3], out + i);
    }
  for (; i < n; ++i) out[i] = dot_row(a, rows + i * stride, Dh);
}

// acc[0..NV W) += sum over i < n of p[i] * rows[i * stride ..]: the NV accumulators stay in registers across the
// rows (position by position, as one axpy per row would add them)
template <int NV>
inline void axpy_rows(float* acc, const float* p, const float* rows, int64_t stride, int64_t n) {
  vf a[NV];
  for (int v = 0; v < NV; ++v) a[v] = load(acc + v * W);
  for (int64_t i = 0; i < n; ++i) {
    const vf pv = splat(p[i]);
    for (int v = 0; v < NV; ++v) a[v] += pv * load(rows + i * stride + v * W);
  }
  for (int v = 0; v < NV; ++v) store(acc + v * W, a[v]);
}

// acc[0..Dh) += sum over i < n of p[i] * rows[i * stride + 0..Dh)
inline void axpy_run(float* acc, const float* p, const float* rows, int64_t stride, int64_t n, int64_t Dh) {
  int64_t d = 0;
  for (; d + 4 * W <= Dh; d += 4 * W) axpy_rows<4>(acc + d, p, rows + d, stride, n);
  for (; d + W <= Dh; d += W) axpy_rows<1>(acc + d, p, rows + d, stride, n);
  for (; d < Dh; ++d)
    for (int64_t i = 0; i < n; ++i) acc[d] += p[i] * rows[i * stride + d];
}

// n cache rows of Dh values (src, `stride` elements apart) as float32: a float cache in place; bf16 widened into
// buf [n, Dh] once, for all G query heads. Sets `stride` to the returned rows' stride.
template <typename T>
inline const float* float_rows(const T* src, int64_t n, int64_t& stride, int64_t Dh, float* buf) {
  if constexpr (sizeof(T) == 4) {
    return (const float*)src;
  } else {
    for (int64_t i = 0; i < n; ++i) {
      int64_t d = 0;
      for (; d + W <= Dh; d += W) store(buf + i * Dh + d, load_row(src + i * stride + d));
      for (; d < Dh; ++d) buf[i * Dh + d] = load_one(src + i * stride + d);
    }
    stride = Dh;
    return buf;
  }
}

// floats of scratch decode_attention_task needs for G query heads of Dh over n_ctx positions (blocks of block_size)
inline int64_t attention_scratch(int64_t G, int64_t Dh, int64_t n_ctx, int64_t block_size) {
  return G * (2 * Dh + n_ctx) + std::min(block_size, n_ctx) * Dh;
}

// Attention of one new token per sequence over its paged context, for one (sequence b, KV head g). cache:
// [2, slots, Hkv, Dh] for this layer (keys then values); q/out: [B, H, Dh]; table: the sequence's block ids;
// len: its context length. The G = H / Hkv query heads of a KV head share each key and value read: a run of
// positions within a block is widened to float32 once, then each head passes over it. float32 scores, softmax
// and sums; `scratch` holds attention_scratch(G, Dh, len, block_size) floats.
template <typename T>
inline void decode_attention_task(const T* q, const T* cache, int64_t slots, const int64_t* table, int64_t len,
                                  int64_t window, int64_t b, int64_t g, int64_t H, int64_t Hkv, int64_t Dh,
                                  int64_t block_size, float scale, T* out, float* scratch) {
  const int64_t G = H / Hkv, kv_stride = Hkv * Dh;
  // positions [begin, len): the whole context, or with a window (> 0) its last `window` positions
  const int64_t begin = window > 0 ? std::max<int64_t>(0, len - window) : 0, n_ctx = len - begin;
  float* qv = scratch;                // [G, Dh]
  float* scores = qv + G * Dh;        // [G, n_ctx]
  float* acc = scores + G * n_ctx;    // [G, Dh]
  float* run = acc + G * Dh;          // [<= block_size, Dh]: a run's keys or values as float32
  for (int64_t j = 0; j < G * Dh; ++j) qv[j] = load_one(q + (b * H + g * G) * Dh + j) * scale;
  // run by run within a block: the slot of position t is table[t / block_size] * block_size + t % block_size
  for (int64_t t = begin; t < len;) {
    const int64_t off = t % block_size, n = std::min(block_size - off, len - t);
    int64_t stride = kv_stride;
    const float* kb = float_rows(cache + (table[t / block_size] * block_size + off) * kv_stride + g * Dh, n, stride,
                                 Dh, run);
    for (int64_t j = 0; j < G; ++j) dot_rows(qv + j * Dh, kb, stride, n, Dh, scores + j * n_ctx + t - begin);
    t += n;
  }
  for (int64_t j = 0; j < G; ++j) {
    float* sc = scores + j * n_ctx;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n_ctx; ++t) mx = std::max(mx, sc[t]);
    int64_t t = 0;
    vf sums = {};
    for (; t + W <= n_ctx; t += W) {
      const vf e = exp_neg(load(sc + t) - splat(mx));
      store(sc + t, e);
      sums += e;
    }
    sum = hsum(sums);
    for (; t < n_ctx; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    const float inv = 1.0f / sum;
    for (t = 0; t < n_ctx; ++t) sc[t] *= inv;
  }
  std::fill(acc, acc + G * Dh, 0.f);
  for (int64_t t = begin; t < len;) {
    const int64_t off = t % block_size, n = std::min(block_size - off, len - t);
    int64_t stride = kv_stride;
    const float* vb = float_rows(cache + (slots + table[t / block_size] * block_size + off) * kv_stride + g * Dh, n,
                                 stride, Dh, run);
    for (int64_t j = 0; j < G; ++j) axpy_run(acc + j * Dh, scores + j * n_ctx + t - begin, vb, stride, n, Dh);
    t += n;
  }
  for (int64_t j = 0; j < G * Dh; ++j) {
    T* o = out + (b * H + g * G) * Dh + j;
    if constexpr (sizeof(T) == 2) *(uint16_t*)o = float_to_bf16(acc[j]);
    else *(float*)o = acc[j];
  }
}

// The index of the largest of x[0..n) (float32), as torch.argmax: the first of equal maxima; the first NaN where
// there is one. Lane by lane, then across lanes; torch's reduction took ~6% of a 16-row decode step (Xeon).
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
