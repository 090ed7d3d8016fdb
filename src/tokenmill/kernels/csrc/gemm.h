// out[M, N] = x[M, K] @ w[N, K]^T for weights packed in panels of P=16 output channels (see formats.py).
//
// The dense formats keep a panel's weights k-major (for each k, the P channels side by side), so one vector load
// gives W channels at one k, the activation x[m, k] is broadcast, and an FMA updates W outputs at once: no
// horizontal sums, and the weights are read once per tile of MT rows, converted in registers, never copied.
//   bf16:  panel = [K][P] bfloat16
//   f32:   panel = [K][P] float32
// The quantized formats (K/32 blocks of P fp16 scales and P x 32 values per panel, in groups of 4 k: GGUF's
// bytes per weight) multiply in integer arithmetic, over quantized activations: qdot.h.
//   Q8_0:  w = d * q, q int8;  Q4_0: w = d * (q - 8), q 4-bit
#pragma once

#include "simd.h"

namespace tmk {

enum Format { BF16 = 0, Q8_0 = 1, Q4_0 = 2, F32 = 3 };
constexpr int QK = 32;  // weights per quantization block

// bytes of one quantized block of a panel: P fp16 scales, then P x 32 values (int8, or two 4-bit per byte)
constexpr int64_t quant_block_bytes(Format f) { return f == Q8_0 ? 2 * P + QK * P : 2 * P + QK / 2 * P; }

inline int64_t panel_bytes(Format f, int64_t K) {
  if (f == BF16) return K * P * 2;
  if (f == F32) return K * P * 4;
  return (K / QK) * quant_block_bytes(f);
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

}  // namespace tmk
