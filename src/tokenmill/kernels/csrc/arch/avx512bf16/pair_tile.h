// The bf16 pair tile with AVX-512 BF16: one vdpbf16ps multiplies a k pair of the panel's 16 channels (the
// panel's k-pair layout is its operand) by a row's activation pair (one broadcast word). linear/pair_tile.h picks
// this file.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "arch/avx512bf16/dp_broadcast.h"
#include "core/cpu.h"
#include "core/simd.h"
#include "linear/common.h"
#include "linear/pair_rows.h"

#if !TM_BF16_PAIRS
#error "arch/avx512bf16/pair_tile.h is for 16-lane builds with AVX-512 BF16 (the avx512bf16 variant)"
#endif

namespace tmk {

template <size_t... M>
inline void dp_rows(__m512* a, __m512 w, const int32_t* pairs, std::index_sequence<M...>) {
  ((a[M] = dpbf16_broadcast<M * PG * 4>(a[M], w, pairs)), ...);  // row M's pair PG words on
}

// PairMajor: xh holds the MT rows' pairs pair-major (linear/pair_rows.h), so one pointer and constant offsets reach
// every row's pair; otherwise the rows lie ldxh apart.
template <int MT, int S, bool PairMajor = false>
inline void tile_bf16_pairs(const uint16_t* panel, const uint16_t* xh, int64_t ldxh, int64_t K, vf (*acc)[V]) {
  const int64_t pairs = K / 2;
  static_assert(V == 1, "one 16-channel vector per panel row");
  // Software prefetch in the one-row tile too on Intel CPUs only: one row streams best on the hardware's prefetch
  // alone on a Zen 4, while a Xeon's is faster with it.
  const bool prefetch = MT > 1 || intel_cpu;
  __m512 a[S][MT];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m) a[s][m] = _mm512_setzero_ps();
  if constexpr (PairMajor && MT > 1 && S == 1) {
    for (int64_t g = 0; g * PG < pairs; ++g) {
      const int32_t* at = (const int32_t*)xh + g * MT * PG;  // row 0's pair j; row m's PG words further
      for (int64_t j = g * PG; j < std::min(pairs, g * PG + PG); ++j, ++at) {
        prefetch_ahead(panel, j);
        const __m512 w = _mm512_castsi512_ps(_mm512_loadu_si512((const void*)(panel + j * 2 * P)));
        dp_rows(a[0], w, at, std::make_index_sequence<MT>{});
      }
    }
  } else {
    auto dp = [&](int64_t j, __m512* set) {
      if (prefetch) prefetch_ahead(panel, j);
      const __m512bh w = (__m512bh)_mm512_loadu_si512((const void*)(panel + j * 2 * P));
      for (int m = 0; m < MT; ++m) {
        int32_t pair;  // x[m][2j] in the low half, x[m][2j + 1] in the high one: the same order as the weights
        std::memcpy(&pair, PairMajor ? xh + 2 * ((j / PG * MT + m) * PG + j % PG) : xh + m * ldxh + 2 * j, 4);
        set[m] = _mm512_dpbf16_ps(set[m], w, (__m512bh)_mm512_set1_epi32(pair));
      }
    };
    int64_t j = 0;
    for (; j + S <= pairs; j += S)
      for (int s = 0; s < S; ++s) dp(j + s, a[s]);
    for (; j < pairs; ++j) dp(j, a[0]);
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < MT; ++m) acc[m][0] += (vf)a[s][m];
}

}  // namespace tmk
