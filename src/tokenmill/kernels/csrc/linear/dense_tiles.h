// out[M, N] = x[M, K] @ w[N, K]^T for weights packed in panels of P=16 output channels (see formats.py).
//
// The dense formats keep a panel's weights k-major (for each k, the P channels side by side), so one vector load
// gives W channels at one k, the activation x[m, k] is broadcast, and an FMA updates W outputs at once: no
// horizontal sums, and the weights are read once per tile of MT rows, converted in registers, never copied.
//   bf16:  panel = [K/2][P][2] bfloat16: k in pairs, so one load gives W channels at k and k + 1 as 32-bit
//          lanes, and a bf16 becomes a float with one shift (k) or one mask (k + 1); K is even (padded)
//   f32:   panel = [K][P] float32
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/simd.h"
#include "linear/common.h"

namespace tmk {

// The running sums a[s][m][v] of MT rows of x (row stride ldx) over the k pairs [j0, j1) of a bf16 (T = uint16_t)
// or float32 panel: a[s][m][v] += x[m][2j] * w[2j][v*W..] + x[m][2j + 1] * w[2j + 1][v*W..]. S sets of sums take
// the pairs in turn (S > 1: more independent FMA chains for one row). With S = 1 the sums are the same bits
// whether the pairs come in one span or in several (K-blocked tiles); `Prefetch` asks for the weights ahead.
template <int MT, int S, bool Prefetch = true, typename T = uint16_t>
inline void span_dense(const T* panel, const float* x, int64_t ldx, int64_t j0, int64_t j1, vf (*a)[MT][V]) {
  auto step = [&](int64_t j, vf (*set)[V]) {
    // a float32 row streams fine on the hardware's prefetch alone (a software prefetch slowed it)
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
  // same products in the same order as in `step` (even k, then odd): the same bits. Each vector of the pair through
  // every row in turn (the activations broadcast for each, each sum's two products back to back) left the FMA
  // units half idle.
  auto step_halves = [&](int64_t j, vf (*set)[V]) {
    if constexpr (Prefetch) prefetch_ahead(panel, j);
    for (int h = 0; h < 2; ++h) {
      vf w[V];
      for (int v = 0; v < V; ++v) {
        const uint16_t* at = (const uint16_t*)panel + j * 2 * P + v * 2 * W;
        w[v] = MT >= 6 ? load_bf16_half_tight(at, h) : load_bf16_half(at, h);  // 6 rows: 15 registers without the mask
      }
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

}  // namespace tmk
