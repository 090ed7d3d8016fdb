// out[M, N] = x[M, K] @ w[N, K]^T for weights packed in panels of P=16 output channels (see formats.py).
//
// The dense formats keep a panel's weights k-major (for each k, the P channels side by side), so one vector load
// gives W channels at one k, the activation x[m, k] is broadcast, and an FMA updates W outputs at once: no
// horizontal sums, and the weights are read once per tile of MT rows, converted in registers, never copied.
//   bf16:  panel = [K/2][P][2] bfloat16: k in pairs, so one load gives W channels at k and k + 1 as 32-bit
//          lanes, and a bf16 becomes a float with one shift (k) or one mask (k + 1); K is even (padded)
//   f32:   panel = [K][P] float32
// The quantized formats (K/32 blocks of P fp16 scales and P x 32 values per panel, in groups of 4 k: GGUF's
// bytes per weight) multiply in integer arithmetic, over quantized activations: qdot.h.
//   Q8_0:  w = d * q, q int8;  Q4_0: w = d * (q - 8), q 4-bit
#pragma once

#include <type_traits>

#include "simd.h"

namespace tmk {

enum Format { BF16 = 0, Q8_0 = 1, Q4_0 = 2, F32 = 3 };
constexpr int QK = 32;  // weights per quantization block
// panels that take several register tiles run them span by span of K, SPAN_BYTES of weights a span (dense.h:
// panel_spans; qdot.h: qpanel, its tiles of 3 or 8); tests and A/B runs turn that off
inline bool kspans = true;
constexpr int64_t SPAN_BYTES = 8192;

// bytes of one quantized block of a panel: P fp16 scales, then P x 32 values (int8, or two 4-bit per byte)
constexpr int64_t quant_block_bytes(Format f) { return f == Q8_0 ? 2 * P + QK * P : 2 * P + QK / 2 * P; }

inline int64_t panel_bytes(Format f, int64_t K) {
  if (f == BF16) return K * P * 2;  // K even
  if (f == F32) return K * P * 4;
  return (K / QK) * quant_block_bytes(f);
}

// One output row's sums for channels n0.. (n_valid of them) -> out[row], plus bias, in the output dtype (out16
// when it is set, else out32).
inline void store_outputs(const float* sums, int64_t row, int64_t n0, int64_t n_valid, int64_t N, const float* bias,
                          float* out32, uint16_t* out16) {
  if (n_valid == P) {  // a whole panel W lanes at a time, the same values: at K = 896 the scalar loop below took ~8%
    for (int v = 0; v < V; ++v) {  // of a 16-row pair tile's time (Zen 4)
      const vf y = load(sums + v * W) + (bias ? load(bias + n0 + v * W) : splat(0.f));
      if (out16) store_bf16(out16 + row * N + n0 + v * W, y);
      else store(out32 + row * N + n0 + v * W, y);
    }
    return;
  }
  for (int64_t i = 0; i < n_valid; ++i) {
    const float y = sums[i] + (bias ? bias[n0 + i] : 0.f);
    if (out16) out16[row * N + n0 + i] = float_to_bf16(y);
    else out32[row * N + n0 + i] = y;
  }
}

// The W channels v*W.. of a panel at k-pair j: their weights at k = 2j (`even`) and 2j + 1 (`odd`), as floats.
inline void load_pair(const uint16_t* panel, int64_t j, int v, vf& even, vf& odd) { load_bf16_pair(panel + j * 2 * P + v * 2 * W, even, odd); }
inline void load_pair(const float* panel, int64_t j, int v, vf& even, vf& odd) {
  even = load(panel + 2 * j * P + v * W), odd = load(panel + (2 * j + 1) * P + v * W);
}
inline vf load_weight(const float* panel, int64_t k, int v) { return load(panel + k * P + v * W); }

// Ask for the weights a prefetch distance past k-pair j of a panel (the next panel's, at its end: panels lie back to
// back; simd.h). Tiles of a few rows compute while the weights stream; without this the two barely overlap (Zen
// 3, weights from memory: bf16 1-row 1.15x, 5 rows 1.25x, 16 rows 1.07x; float32 5 rows 1.2x).
template <typename T>
inline void prefetch_ahead(const T* panel, int64_t j) {
  constexpr int64_t pair_bytes = 2 * P * sizeof(T);
  for (int64_t b = 0; b < pair_bytes; b += 64) prefetch_weights((const char*)panel + j * pair_bytes + b);
}

// The running sums a[s][m][v] of MT rows of x (row stride ldx) over the k pairs [j0, j1) of a bf16 (T = uint16_t)
// or float32 panel: a[s][m][v] += x[m][2j] * w[2j][v*W..] + x[m][2j + 1] * w[2j + 1][v*W..]. S sets of sums take
// the pairs in turn (S > 1: more independent FMA chains for one row). With S = 1 the sums are the same bits
// whether the pairs come in one span or in several (K-blocked tiles); `Prefetch` asks for the weights ahead.
template <int MT, int S, bool Prefetch = true, typename T = uint16_t>
inline void span_dense(const T* panel, const float* x, int64_t ldx, int64_t j0, int64_t j1, vf (*a)[MT][V]) {
  auto step = [&](int64_t j, vf (*set)[V]) {
    // a float32 row streams fine on the hardware's prefetch alone (software prefetch: 0.9x)
    if constexpr (Prefetch && (MT > 1 || !std::is_same_v<T, float>)) prefetch_ahead(panel, j);
    vf we[V], wo[V];
    for (int v = 0; v < V; ++v) load_pair(panel, j, v, we[v], wo[v]);
    for (int m = 0; m < MT; ++m) {
      const vf xe = splat(x[m * ldx + 2 * j]), xo = splat(x[m * ldx + 2 * j + 1]);
      for (int v = 0; v < V; ++v) {
        set[m][v] += we[v] * xe;  // two FMAs (not a product plus an FMA)
        set[m][v] += wo[v] * xo;
      }
    }
  };
  // bf16 in 8-lane builds, 4-6 rows: the pair's even k for every row, then its odd k, so that two weight vectors
  // live beside 6 rows' 12 accumulators and each row's activation is broadcast once for both. Each sum takes the
  // same products in the same order as in `step` (even k, then odd): the same bits. One 6-row tile from L1, one
  // thread (Xeon): 55% of the FMA peak when each vector of the pair went through every row in turn (the
  // activations broadcast for each, each sum's two products back to back), 95% this way.
  auto step_halves = [&](int64_t j, vf (*set)[V]) {
    if constexpr (Prefetch) prefetch_ahead(panel, j);
    for (int h = 0; h < 2; ++h) {
      vf w[V];
      for (int v = 0; v < V; ++v) w[v] = load_bf16_half((const uint16_t*)panel + j * 2 * P + v * 2 * W, h);
      for (int m = 0; m < MT; ++m) {
        const vf xb = splat(x[m * ldx + 2 * j + h]);
        for (int v = 0; v < V; ++v) set[m][v] += w[v] * xb;
      }
    }
  };
  int64_t j = j0;
  if constexpr (W == 8 && V == 2 && MT >= 4 && S == 1 && !std::is_same_v<T, float>) {
    for (; j < j1; ++j) step_halves(j, a[0]);
  }
  for (; j + S <= j1; j += S)
    for (int s = 0; s < S; ++s) step(j + s, a[s]);
  for (; j < j1; ++j) step(j, a[0]);
}

// acc[m][v] += sum_k x[m][k] * w[k][v*W..] over the whole panel, in one pass (span_dense); a float32 panel of odd K
// ends with one k alone.
template <int MT, int S, typename T = uint16_t>
inline void tile_dense(const T* panel, const float* x, int64_t ldx, int64_t K, vf (*acc)[V]) {
  vf a[S][MT][V] = {};
  span_dense<MT, S, true, T>(panel, x, ldx, 0, K / 2, a);
  if constexpr (std::is_same_v<T, float>) {
    if (K % 2)
      for (int m = 0; m < MT; ++m)
        for (int v = 0; v < V; ++v) a[0][m][v] += load_weight(panel, K - 1, v) * splat(x[m * ldx + K - 1]);
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] += a[s][m][v];
}

// bf16 weights times bf16 activations read as pairs straight from the model's rows (xh, row stride ldxh; K even):
// acc[m][v] += w[2j] x[m][2j] + w[2j + 1] x[m][2j + 1] for every pair j. With AVX-512 BF16 one vdpbf16ps does a
// pair for 16 channels (the panel's k-pair layout is its operand, the activation pair one broadcast word); the
// products are exact in float32 either way, so only the order of the float32 sums differs from tile_dense. Other
// builds compute the same sums with FMAs, so that the tests can run this path's plumbing on any CPU.
inline bool bf16_dot_native() {
#if defined(__AVX512BF16__) && TM_W == 16
  return true;
#else
  return false;
#endif
}
// -1: pairs where the CPU has vdpbf16ps (the default); 0: never; 1: always (tests)
inline int bf16_dot = -1;
inline bool use_bf16_dot() { return bf16_dot < 0 ? bf16_dot_native() : bf16_dot > 0; }

template <int MT, int S>
inline void tile_bf16_pairs(const uint16_t* panel, const uint16_t* xh, int64_t ldxh, int64_t K, vf (*acc)[V]) {
  const int64_t pairs = K / 2;
#if defined(__AVX512BF16__) && TM_W == 16
  static_assert(V == 1, "one 16-channel vector per panel row");
  // Software prefetch in the one-row tile too on Intel CPUs only: one row streams best on the hardware's prefetch
  // alone on a Zen 4 (2 threads: 1.08x), while a Xeon's is faster with it (24 layers' bf16 linears from memory at
  // one row: 21.7 -> 24.0 GB/s).
  const bool prefetch = MT > 1 || intel_cpu;
  __m512 a[S][MT];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m) a[s][m] = _mm512_setzero_ps();
  auto step = [&](int64_t j, __m512* set) {
    if (prefetch) prefetch_ahead(panel, j);
    const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(panel + j * 2 * P));
    for (int m = 0; m < MT; ++m) {
      int32_t pair;  // x[m][2j] in the low half, x[m][2j + 1] in the high one: the same order as the weights
      std::memcpy(&pair, xh + m * ldxh + 2 * j, 4);
      set[m] = _mm512_dpbf16_ps(set[m], w, (__m512bh)_mm512_set1_epi32(pair));
    }
  };
  int64_t j = 0;
  for (; j + S <= pairs; j += S)
    for (int s = 0; s < S; ++s) step(j + s, a[s]);
  for (; j < pairs; ++j) step(j, a[0]);
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m) acc[m][0] += (vf)a[s][m];
#else
  auto widen = [](uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  vf a[S][MT][V] = {};
  auto step = [&](int64_t j, vf (*set)[V]) {
    prefetch_ahead(panel, j);
    vf we[V], wo[V];
    for (int v = 0; v < V; ++v) load_pair(panel, j, v, we[v], wo[v]);
    for (int m = 0; m < MT; ++m) {
      const vf xe = splat(widen(xh[m * ldxh + 2 * j])), xo = splat(widen(xh[m * ldxh + 2 * j + 1]));
      for (int v = 0; v < V; ++v) {
        set[m][v] += we[v] * xe;
        set[m][v] += wo[v] * xo;
      }
    }
  };
  int64_t j = 0;
  for (; j + S <= pairs; j += S)
    for (int s = 0; s < S; ++s) step(j + s, a[s]);
  for (; j < pairs; ++j) step(j, a[0]);
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] += a[s][m][v];
#endif
}

}  // namespace tmk
