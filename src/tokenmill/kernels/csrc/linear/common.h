// What every linear kernel shares: reading a dense panel's weights, asking for them ahead, storing a row's sums
// as outputs, and the switch for tiles over spans of K.
#pragma once

#include <cstdint>
#include <type_traits>

#include "core/cpu.h"
#include "core/simd.h"

namespace tmk {

// panels that take several register tiles run them span by span of K, SPAN_BYTES of weights a span
// (linear/dense.h: panel_spans; linear/qpanel.h: qpanel, its tiles of 3 or 8); tests and A/B runs turn that off
inline bool kspans = true;
constexpr int64_t SPAN_BYTES = 8192;

// One output row's sums for channels n0.. (n_valid of them) -> out[row], plus bias, in the output dtype (out16
// when it is set, else out32).
inline void store_outputs(const float* sums, int64_t row, int64_t n0, int64_t n_valid, int64_t N, const float* bias,
                          float* out32, uint16_t* out16) {
  if (n_valid == P) {  // a whole panel W lanes at a time, the same values: the scalar loop below was a visible
    for (int v = 0; v < V; ++v) {  // share of a many-row tile's time
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
// back; core/cpu.h). Tiles of a few rows compute while the weights stream; without this the two barely overlap.
template <typename T>
inline void prefetch_ahead(const T* panel, int64_t j) {
  constexpr int64_t pair_bytes = 2 * P * sizeof(T);
  for (int64_t b = 0; b < pair_bytes; b += 64) prefetch_weights((const char*)panel + j * pair_bytes + b);
}

}  // namespace tmk
