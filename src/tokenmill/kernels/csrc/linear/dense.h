// The dense formats' (bf16, float32) register tiles over whole panels, for a few rows: which tile takes how many
// rows, bf16 panels in spans of K when several tiles share them, and the output panels of a range. Many rows take
// the blocked GEMM (linear/blocked.h) instead; linear_range (linear/linear.h) picks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/simd.h"
#include "linear/common.h"
#include "linear/dense_tiles.h"
#include "linear/pair_rows.h"
#include "linear/pair_tile.h"

namespace tmk {

// rows of one dense tile at this vector width (what fits in the register file; 8 lanes: 6 with dense_tiles.h's even-then-
// odd step for bf16, 12 sums, 2 weights and a broadcast, the odd half's mask a memory operand: arch/avx2/simd.h).
// Where a block's rows take several tiles, 16 rows as 5 + 5 + 6 ran 1.11x faster than as 4 x 4 when the mask no
// longer cost a sum its register (Xeon, avx2 variant: docs/benchmarks.md)
constexpr int MT_DENSE = W == 4 ? 2 : (W == 8 ? 6 : 8);
// `rows` <= MT rows of x times a dense panel, in the tile of exactly that many (one row: 4 accumulator sets)
template <typename T, int MT>
void panel_rows(const T* panel, const float* x, int64_t ldx, int64_t K, int64_t rows, vf (*acc)[V]) {
  with_rows<MT>(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    tile_dense<R, R == 1 ? 4 : 1>(panel, x, ldx, K, acc);
  });
}

// k pairs per span of a K-blocked bf16 panel (a pair: 2 k x P channels x 2 bytes): 128, with 16 rows' activations
// 24 KB of L1
constexpr int64_t KSPAN = SPAN_BYTES / (4 * P);
constexpr int64_t KSPAN_ROWS = 48;  // rows at most (the sums wait on the stack)

// `rows` rows of x (2..KSPAN_ROWS) times a bf16 panel, in `tiles` tiles (tile_start: 2 rows or more each), with K cut
// into spans: every tile runs over one span before the next span starts, so a span's weights come from memory once, for
// the first tile, and the later tiles find them in L1. One pass per tile instead read the panel from memory for the
// first and from L2 for the others, and the first tile waited on memory. The sums wait in `sums` between spans and
// take each span's pairs in order (span_dense, one set), so they are the same bits as one pass per tile.
template <int MT>
void panel_spans(const uint16_t* panel, const float* x, int64_t ldx, int64_t K, int64_t rows, int64_t tiles,
                 vf (*sums)[V]) {
  for (int64_t m = 0; m < rows; ++m)
    for (int v = 0; v < V; ++v) sums[m][v] = splat(0.f);
  for (int64_t j0 = 0; j0 < K / 2; j0 += KSPAN) {
    const int64_t j1 = std::min(K / 2, j0 + KSPAN);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = tile_start(rows, tiles, t);
      with_rows<MT, 2>(tile_start(rows, tiles, t + 1) - m0, [&](auto r) {
        constexpr int R = decltype(r)::value;
        vf a[1][R][V];
        for (int m = 0; m < R; ++m)
          for (int v = 0; v < V; ++v) a[0][m][v] = sums[m0 + m][v];
        if (m0 == 0) span_dense<R, 1, true>(panel, x + m0 * ldx, ldx, j0, j1, a);
        else span_dense<R, 1, false>(panel, x + m0 * ldx, ldx, j0, j1, a);  // in L1 since the first tile
        for (int m = 0; m < R; ++m)
          for (int v = 0; v < V; ++v) sums[m0 + m][v] = a[0][m][v];
      });
    }
  }
}

// rows [r0, r0 + n) of x times a bf16 panel over spans of K (panel_spans), in `tiles` tiles -> their outputs
inline void spans_to_outputs(const uint16_t* panel, const float* x, int64_t ldx, int64_t K, int64_t r0, int64_t n,
                             int64_t tiles, int64_t n0, int64_t n_valid, int64_t N, const float* bias, float* out32,
                             uint16_t* out16) {
  vf sums[KSPAN_ROWS][V];
  panel_spans<MT_DENSE>(panel, x + r0 * ldx, ldx, K, n, tiles, sums);
  for (int64_t m = 0; m < n; ++m) {
    float lane[P];
    for (int v = 0; v < V; ++v) {
      vf acc = {};
      acc += sums[m][v];  // as the tiles add their sums to zeroed accumulators
      store(lane + v * W, acc);
    }
    store_outputs(lane, r0 + m, n0, n_valid, N, bias, out32, out16);
  }
}

// the same for bf16 activation pairs: a tile's rows pair-major from `xt` (linear/pair_rows.h), or `rows` rows
// ldxh apart (linear/pair_tile.h: tile_bf16_pairs)
template <int MT>
void pair_rows(const uint16_t* panel, const uint16_t* xt, int64_t ldxh, bool pair_major, int64_t K, int64_t rows,
               vf (*acc)[V]) {
  with_rows<MT>(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    if (pair_major) tile_bf16_pairs<R, R == 1 ? 4 : 1, true>(panel, xt, 0, K, acc);
    else tile_bf16_pairs<R, R == 1 ? 4 : 1>(panel, xt, ldxh, K, acc);
  });
}

// Output panels [p_begin, p_end) of out[M, N] = x[M, K] @ w^T (+ bias) for a dense format (T: uint16_t for bf16,
// float for f32); x float32 (see prep_row), out in float32 (out32) or bfloat16 (out16). For bf16, `xh` (when
// not null) holds the same rows as bfloat16 pairs, pair-major (linear/pair_rows.h) or ldxh apart, and the pair
// tiles take them.
template <typename T>
void linear_panels(const float* x, int64_t M, int64_t ldx, const uint8_t* packed, int64_t N, int64_t K,
                   const float* bias, float* out32, uint16_t* out16, int64_t p_begin, int64_t p_end,
                   const uint16_t* xh, int64_t ldxh, bool pair_major) {
  const int64_t stride = K * P * (int64_t)sizeof(T);
  const int64_t mt = xh ? MT_PAIRS : MT_DENSE, block = row_block(K, xh ? 2 : 4, mt);
  for (int64_t r0 = 0; r0 < M; r0 += block) {
    // the block's rows in the fewest tiles, of even sizes: 8 rows as 4 + 4, not 6 + 2; 16 as 5 + 5 + 6
    const int64_t r1 = std::min(M, r0 + block);
    const int64_t n = r1 - r0, tiles = tile_count(n, mt);
    for (int64_t p = p_begin; p < p_end; ++p) {
      const T* panel = (const T*)(packed + p * stride);
      const int64_t n0 = p * P, n_valid = std::min<int64_t>(P, N - n0);
      if constexpr (std::is_same_v<T, uint16_t>) {
        // (every tile of 2 rows or more: a 4-lane build's tiles of at most 2 rows leave 3 rows as 1 + 2)
        const bool spans = kspans && tiles > 1 && n / tiles >= 2 && K / 2 > KSPAN && n <= KSPAN_ROWS;
        if (!xh && spans) {
          spans_to_outputs(panel, x, ldx, K, r0, n, tiles, n0, n_valid, N, bias, out32, out16);
          continue;
        }
      }
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = r0 + tile_start(n, tiles, t), rows = r0 + tile_start(n, tiles, t + 1) - m0;
        vf acc[std::max(MT_DENSE, MT_PAIRS)][V] = {};
        if constexpr (std::is_same_v<T, uint16_t>) {
          if (xh && pair_major) pair_rows<MT_PAIRS>(panel, xh + 2 * m0 * pair_row_words(K), 0, true, K, rows, acc);
          else if (xh) pair_rows<MT_PAIRS>(panel, xh + m0 * ldxh, ldxh, false, K, rows, acc);
          else panel_rows<T, MT_DENSE>(panel, x + m0 * ldx, ldx, K, rows, acc);
        } else {
          panel_rows<T, MT_DENSE>(panel, x + m0 * ldx, ldx, K, rows, acc);
        }
        for (int64_t m = 0; m < rows; ++m) {
          float lane[P];
          for (int v = 0; v < V; ++v) store(lane + v * W, acc[m][v]);
          store_outputs(lane, m0 + m, n0, n_valid, N, bias, out32, out16);
        }
      }
    }
  }
}

}  // namespace tmk
