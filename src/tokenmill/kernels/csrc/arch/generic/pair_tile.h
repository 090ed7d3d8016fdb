// The bf16 pair tile in FMAs, for builds without vdpbf16ps: the same sums as arch/avx512bf16/pair_tile.h, so
// that the tests can run that path's plumbing on any CPU. linear/pair_tile.h picks this file.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/simd.h"
#include "linear/common.h"
#include "linear/pair_rows.h"

namespace tmk {

// PairMajor: xh holds the MT rows' pairs pair-major (linear/pair_rows.h), else the rows lie ldxh apart
template <int MT, int S, bool PairMajor = false>
inline void tile_bf16_pairs(const uint16_t* panel, const uint16_t* xh, int64_t ldxh, int64_t K, vf (*acc)[V]) {
  const int64_t pairs = K / 2;
  auto widen = [](uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  vf a[S][MT][V] = {};
  auto dp = [&](int64_t j, vf (*set)[V]) {
    prefetch_ahead(panel, j);
    vf we[V], wo[V];
    for (int v = 0; v < V; ++v) load_pair(panel, j, v, we[v], wo[v]);
    for (int m = 0; m < MT; ++m) {
      const uint16_t* x = PairMajor ? xh + 2 * ((j / PG * MT + m) * PG + j % PG) : xh + m * ldxh + 2 * j;
      const vf xe = splat(widen(x[0])), xo = splat(widen(x[1]));
      for (int v = 0; v < V; ++v) {
        set[m][v] += we[v] * xe;
        set[m][v] += wo[v] * xo;
      }
    }
  };
  int64_t j = 0;
  for (; j + S <= pairs; j += S)
    for (int s = 0; s < S; ++s) dp(j + s, a[s]);
  for (; j < pairs; ++j) dp(j, a[0]);
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] += a[s][m][v];
}

}  // namespace tmk
