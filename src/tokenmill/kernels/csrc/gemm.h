// out[M, N] = x[M, K] @ w[N, K]^T for weights packed in panels of P=16 output channels (see formats.py).
//
// Every format keeps a panel's weights k-major (for each k, the P channels side by side), so one vector load
// gives W channels at one k, the activation x[m, k] is broadcast, and an FMA updates W outputs at once: no
// horizontal sums, and the weights are read once per tile of MT rows, converted in registers, never copied.
//   bf16:  panel = [K][P] bfloat16
//   f32:   panel = [K][P] float32
//   Q8_0:  panel = K/32 blocks of { fp16 scale[P]; int8 q[32][P] }           w = d * q
//   Q4_0:  panel = K/32 blocks of { fp16 scale[P]; uint8 q[16][P] }           w = d * (q - 8); byte j holds
//          k = 2j in its low nibble and k = 2j + 1 in its high one. Same bytes per weight as GGUF's Q4_0.
#pragma once

#include "simd.h"

namespace tmk {

enum Format { BF16 = 0, Q8_0 = 1, Q4_0 = 2, F32 = 3 };
constexpr int QK = 32;  // weights per quantization block

inline int64_t panel_bytes(Format f, int64_t K) {
  if (f == BF16) return K * P * 2;
  if (f == F32) return K * P * 4;
  if (f == Q8_0) return (K / QK) * (2 * P + QK * P);
  return (K / QK) * (2 * P + QK / 2 * P);
}

// P fp16 block scales -> V float vectors.
inline void load_scales(const uint8_t* p, vf* d) {
#if TM_W == 8 && defined(__F16C__)
  for (int v = 0; v < V; ++v) d[v] = (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + v * W * 2)));
#elif TM_W == 16 && defined(__AVX512F__)
  for (int v = 0; v < V; ++v) d[v] = (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + v * W * 2)));
#else
  float f[P];
  for (int i = 0; i < P; ++i) f[i] = half_to_float(((const uint16_t*)p)[i]);
  for (int v = 0; v < V; ++v) d[v] = load(f + v * W);
#endif
}

// One output row's sums for channels n0.. (n_valid of them) -> out[row], plus bias, in the output dtype (out16
// when it is set, else out32).
inline void store_outputs(const float* sums, int64_t row, int64_t n0, int64_t n_valid, int64_t N, const float* bias,
                          float* out32, uint16_t* out16) {
  for (int64_t i = 0; i < n_valid; ++i) {
    const float y = sums[i] + (bias ? bias[n0 + i] : 0.f);
    if (out16) out16[row * N + n0 + i] = float_to_bf16(y);
    else out32[row * N + n0 + i] = y;
  }
}

inline vf load_weights(const uint16_t* p) { return load_bf16(p); }
inline vf load_weights(const float* p) { return load(p); }

// The raw values (q, or the nibble q for Q4_0) at k = 2j and 2j + 1 of vector v of a quantized block.
template <Format F>
inline void load_pair(const uint8_t* q, int j, int v, vf& w0, vf& w1) {
  if constexpr (F == Q8_0) {
    w0 = load_i8((const int8_t*)q + (2 * j) * P + v * W);
    w1 = load_i8((const int8_t*)q + (2 * j + 1) * P + v * W);
  } else {
    const vi bytes = load_u8(q + j * P + v * W);
    w0 = __builtin_convertvector(bytes & 15, vf);
    w1 = __builtin_convertvector(bytes >> 4, vf);
  }
}

// acc[m][v] += sum_k x[m][k] * w[k][v*W..]: a bf16 (T = uint16_t) or float32 panel, MT rows of x (row stride
// ldx), k-unrolled by U.
template <int MT, int U, typename T = uint16_t>
inline void tile_dense(const T* panel, const float* x, int64_t ldx, int64_t K, vf (*acc)[V]) {
  vf a[U][MT][V] = {};
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int u = 0; u < U; ++u) {
      vf w[V];
      for (int v = 0; v < V; ++v) w[v] = load_weights(panel + (k + u) * P + v * W);
      for (int m = 0; m < MT; ++m) {
        vf xb = splat(x[m * ldx + k + u]);
        for (int v = 0; v < V; ++v) a[u][m][v] += w[v] * xb;
      }
    }
  }
  for (; k < K; ++k) {
    for (int m = 0; m < MT; ++m) {
      vf xb = splat(x[m * ldx + k]);
      for (int v = 0; v < V; ++v) a[0][m][v] += load_weights(panel + k * P + v * W) * xb;
    }
  }
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] += a[u][m][v];
}

// The same over a quantized panel. xs[m * nb + b] is the sum of x[m] over block b (Q4_0's -8 offset).
// One row (GEMV): accumulate q * x per block and scale the block's sum once. Several rows: dequantize each
// weight vector once (w = d * q) and reuse it for every row, which needs no per-block accumulators.
template <Format F, int MT>
inline void tile_quant(const uint8_t* panel, const float* x, int64_t ldx, const float* xs, int64_t K, vf (*acc)[V]) {
  const int64_t nb = K / QK;
  const int64_t block_bytes = F == Q8_0 ? 2 * P + QK * P : 2 * P + QK / 2 * P;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * block_bytes;
    const uint8_t* q = blk + 2 * P;
    const float* xb = x + b * QK;
    vf d[V];
    load_scales(blk, d);
    if constexpr (MT == 1) {
      vf s0[V] = {}, s1[V] = {};  // two chains (even and odd k): an FMA's latency hides behind the other's
      for (int j = 0; j < QK / 2; ++j) {
        const vf x0 = splat(xb[2 * j]), x1 = splat(xb[2 * j + 1]);
        for (int v = 0; v < V; ++v) {
          vf w0, w1;
          load_pair<F>(q, j, v, w0, w1);
          s0[v] += w0 * x0;
          s1[v] += w1 * x1;
        }
      }
      for (int v = 0; v < V; ++v) {
        vf sum = s0[v] + s1[v];
        if constexpr (F == Q4_0) sum -= splat(8.f * xs[b]);
        acc[0][v] += sum * d[v];
      }
    } else {
      vf offset[V];  // Q4_0: w = d * q - 8 d
      for (int v = 0; v < V; ++v) offset[v] = d[v] * splat(F == Q4_0 ? -8.f : 0.f);
      for (int j = 0; j < QK / 2; ++j) {
        for (int v = 0; v < V; ++v) {
          vf w0, w1;
          load_pair<F>(q, j, v, w0, w1);
          w0 = w0 * d[v] + offset[v];
          w1 = w1 * d[v] + offset[v];
          for (int m = 0; m < MT; ++m) acc[m][v] += w0 * splat(xb[m * ldx + 2 * j]) + w1 * splat(xb[m * ldx + 2 * j + 1]);
        }
      }
    }
  }
}

}  // namespace tmk
