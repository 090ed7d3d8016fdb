// A packed panel back as float32 (kernels.cpp's unpack: the prefill path multiplies it with torch's own GEMM).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "core/simd.h"
#include "linear/format.h"
#include "linear/kformat.h"

namespace tmk {

// channel c's weight at k of a bf16 panel (k in pairs: [K/2][P][2]), as float32
inline float bf16_at(const uint8_t* panel, int64_t k, int c) {
  const uint32_t bits = (uint32_t)((const uint16_t*)panel)[(k / 2) * 2 * P + 2 * c + k % 2] << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// One channel c of a bf16 or quantized panel as float32 out[0..K) (a packed embedding's row: stack/stages.h,
// kernels.cpp; bf16: a tied LM head's panels)
template <Format F>
void unpack_channel_t(const uint8_t* panel, int64_t K, int c, float* out) {
  if constexpr (F == BF16) {
    for (int64_t k = 0; k < K; ++k) out[k] = bf16_at(panel, k, c);
  } else if constexpr (is_kfamily(F)) {
    constexpr KSpec S = kspec(F);
    for (int64_t s0 = 0; s0 < K; s0 += S.sb) {
      const KHeader<F> h{panel + s0 / S.sb * ksb_bytes(S)};
      for (int s = 0; s < S.sb / S.sub; ++s) {
        const float scale = h.scale(s, c), mn = h.min(s, c);
        for (int kk = s * S.sub; kk < (s + 1) * S.sub; ++kk)
          out[s0 + kk] = scale * (float)(kvalue<F>(h.block(kk / QK), c, kk % QK) - S.zero) - mn;
      }
    }
  } else {
    static_assert(F == Q8_0 || F == Q4_0, "dense formats are read as they are");
    for (int64_t k0 = 0; k0 < K; k0 += QK) {
      const uint8_t* blk = panel + (k0 / QK) * quant_block_bytes(F);
      const float d = half_to_float(((const uint16_t*)blk)[c]);
      for (int kk = 0; kk < QK; ++kk)
        out[k0 + kk] = d * (float)(block_value<F>(blk + 2 * P, c, kk) - (F == Q4_0 ? 8 : 0));
    }
  }
}

// The panel's n_valid channels -> out[i * K + k] for every k < K.
template <Format F>
void unpack_panel(const uint8_t* panel, int64_t K, int64_t n_valid, float* out) {
  if constexpr (F != F32 && F != BF16) {
    for (int64_t c = 0; c < n_valid; ++c) unpack_channel_t<F>(panel, K, (int)c, out + c * K);
  } else {
    for (int64_t k = 0; k < K; ++k) {
      float vals[P];
      if constexpr (F == F32) {
        std::memcpy(vals, (const float*)panel + k * P, sizeof(vals));
      } else {
        for (int i = 0; i < P; ++i) vals[i] = bf16_at(panel, k, i);
      }
      for (int64_t i = 0; i < n_valid; ++i) out[i * K + k] = vals[i];
    }
  }
}

inline void unpack_channel(Format F, const uint8_t* panel, int64_t K, int c, float* out) {
  switch (F) {
    case BF16: return unpack_channel_t<BF16>(panel, K, c, out);
    case Q8_0: return unpack_channel_t<Q8_0>(panel, K, c, out);
    case Q4_0: return unpack_channel_t<Q4_0>(panel, K, c, out);
    case Q4_K: return unpack_channel_t<Q4_K>(panel, K, c, out);
    case Q5_K: return unpack_channel_t<Q5_K>(panel, K, c, out);
    case Q6_K: return unpack_channel_t<Q6_K>(panel, K, c, out);
    case Q5_0: return unpack_channel_t<Q5_0>(panel, K, c, out);
    case Q5_1: return unpack_channel_t<Q5_1>(panel, K, c, out);
    case Q4_1: return unpack_channel_t<Q4_1>(panel, K, c, out);
    case IQ4_NL: return unpack_channel_t<IQ4_NL>(panel, K, c, out);
    case IQ4_XS: return unpack_channel_t<IQ4_XS>(panel, K, c, out);
    case MXFP4: return unpack_channel_t<MXFP4>(panel, K, c, out);
    default: throw std::invalid_argument("unpack_channel takes bf16 and the quantized formats");
  }
}

// rows ids[0..T) of a packed weight [N, K] (bf16 or quantized) as float32 out[T, K] (an embedding looked up in its
// panels)
inline void unpack_rows(Format F, const uint8_t* w, int64_t K, const int64_t* ids, int64_t T, float* out) {
  const int64_t stride = panel_bytes(F, K);
  for (int64_t t = 0; t < T; ++t) unpack_channel(F, w + ids[t] / P * stride, K, (int)(ids[t] % P), out + t * K);
}

}  // namespace tmk
