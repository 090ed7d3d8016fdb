// Many rows (prefill, batched decode, speculative verification) in bf16 or float32: a cache-blocked GEMM over the
// packed panels. (The quantized formats have their own integer path, linear/quant.h.)
//
// The tiles of linear/dense_tiles.h read each weight straight from its panel, once per tile of rows: right for a few rows,
// where the weights stream from memory once and the conversion hides behind that stream. With many rows the
// same weight is converted again for every tile, and each tile re-reads its rows of x along the whole of K,
// which falls out of the caches when K is long. Here, as in every BLAS (Goto's layout):
// - K is cut into blocks of KC. A panel's KC x P weights are converted to float32 once, into a 16 KB buffer
//   that stays in L1, and every tile of rows reuses them;
// - the rows are cut into blocks of MC, so that the MC x KC block of x (192 KB) stays in L2 while every panel
//   of the range passes over it;
// - partial sums wait in a float32 buffer between K blocks; bias and the output dtype apply once, at the end.
// The inner tile is pure float32: MT_F32 rows x P channels of accumulators, one vector load per P/W channels
// and one broadcast per row at each k.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/simd.h"
#include "linear/common.h"
#include "linear/format.h"

namespace tmk {

constexpr int64_t KC = 256;  // k per block
constexpr int64_t MC = 192;  // rows per block
// rows per register tile: MT x V accumulators + V weights + 1 broadcast fit the register file
constexpr int MT_F32 = W == 4 ? 2 : (W == 8 ? 6 : 12);
// Rows from which the blocked path beats the tiles (measured: docs/benchmarks.md). Tests set `blocked_rows`
// (> 0) to run both paths on the same shapes.
inline int64_t blocked_rows = 0;
inline int64_t blocked_min_rows() { return blocked_rows > 0 ? blocked_rows : 48; }

// k rows [k0, k0 + kc) of a packed panel as float32 [kc][P] in `dst`; returns where they are (an f32 panel is
// used in place).
template <Format F>
inline const float* panel_block_f32(const uint8_t* panel, int64_t k0, int64_t kc, float* dst) {
  if constexpr (F == F32) {
    return (const float*)panel + k0 * P;
  } else {
    static_assert(F == BF16, "quantized formats multiply in integers (linear/quant.h)");
    const uint16_t* src = (const uint16_t*)panel + k0 * P;  // k0 and kc even: whole k pairs
    for (int64_t j = 0; j < kc / 2; ++j)
      for (int v = 0; v < V; ++v) {
        vf even, odd;
        load_bf16_pair(src + j * 2 * P + v * 2 * W, even, odd);
        store(dst + 2 * j * P + v * W, even);
        store(dst + (2 * j + 1) * P + v * W, odd);
      }
    return dst;
  }
}

// c[m][0..P) (+)= sum over kc of x[m * ldx + k] * w[k][0..P), for MT rows; `first` starts from zero.
template <int MT>
inline void tile_f32(const float* w, const float* x, int64_t ldx, int64_t kc, float* c, bool first) {
  vf acc[MT][V];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = first ? splat(0.f) : load(c + m * P + v * W);
  for (int64_t k = 0; k < kc; ++k) {
    vf wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(w + k * P + v * W);
    for (int m = 0; m < MT; ++m) {
      const vf xb = splat(x[m * ldx + k]);
      for (int v = 0; v < V; ++v) acc[m][v] += wv[v] * xb;
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < V; ++v) store(c + m * P + v * W, acc[m][v]);
}

// Output panels [p_begin, p_end) of out[M, N] = x[M, K] @ w^T (+ bias), as linear_panels (linear/dense.h) computes them.
template <Format F>
void linear_blocked(const float* x, int64_t M, int64_t ldx, const uint8_t* packed, int64_t N, int64_t K,
                    const float* bias, float* out32, uint16_t* out16, int64_t p_begin, int64_t p_end) {
  const int64_t stride = panel_bytes(F, K), n_panels = p_end - p_begin;
  alignas(64) float wbuf[KC * P];
  thread_local std::vector<float> cbuf;  // [n_panels][MC][P] partial sums
  cbuf.resize(n_panels * MC * P);
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t mc = std::min(MC, M - m0);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t p = 0; p < n_panels; ++p) {
        const float* w = panel_block_f32<F>(packed + (p_begin + p) * stride, k0, kc, wbuf);
        float* c = cbuf.data() + p * MC * P;
        for (int64_t m = 0; m < mc; m += MT_F32)
          with_rows<MT_F32>(std::min<int64_t>(MT_F32, mc - m), [&](auto rows) {
            tile_f32<decltype(rows)::value>(w, x + (m0 + m) * ldx + k0, ldx, kc, c + m * P, k0 == 0);
          });
      }
    }
    for (int64_t p = 0; p < n_panels; ++p) {
      const int64_t n0 = (p_begin + p) * P, n_valid = std::min<int64_t>(P, N - n0);
      const float* c = cbuf.data() + p * MC * P;
      for (int64_t m = 0; m < mc; ++m) store_outputs(c + m * P, m0 + m, n0, n_valid, N, bias, out32, out16);
    }
  }
}

}  // namespace tmk
