// The bf16 pair tile with AVX-512 BF16: one vdpbf16ps multiplies a k pair of the panel's 16 channels (the
// panel's k-pair layout is its operand) by a row's activation pair (one broadcast word). linear/pair_tile.h picks
// this file.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/cpu.h"
#include "core/simd.h"
#include "linear/common.h"

#if !TM_BF16_PAIRS
#error "arch/avx512bf16/pair_tile.h is for 16-lane builds with AVX-512 BF16 (the avx512bf16 variant)"
#endif

namespace tmk {

template <int MT, int S>
inline void tile_bf16_pairs(const uint16_t* panel, const uint16_t* xh, int64_t ldxh, int64_t K, vf (*acc)[V]) {
  const int64_t pairs = K / 2;
  static_assert(V == 1, "one 16-channel vector per panel row");
  // Software prefetch in the one-row tile too on Intel CPUs only: one row streams best on the hardware's prefetch
  // alone on a Zen 4, while a Xeon's is faster with it.
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
}

}  // namespace tmk
