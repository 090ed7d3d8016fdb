// Decode attention: one new token per sequence over its paged KV cache, for one (sequence, KV head, split of
// kSplit positions) at a time; a sequence's splits are then merged (flash-decoding). With one sequence, the splits
// are what the threads share: by KV head alone, a model with one or two KV heads kept one or two threads busy
// however long its context.
//
// The G = H / Hkv query heads of a KV head share every key and value read. Scores, softmax and the weighted sum
// of values are float32. Two paths:
// - the portable one (every ISA, every cache dtype): a run of positions within a block is widened to
//   float32 once, then each head passes over it (a dot product per position, a vector sum per head);
// - with AVX-512 BF16 (arch/avx512bf16/attention.h), for a bf16 model's cache (Dh a multiple of 32): 16 positions'
//   keys are loaded as 16 rows of bf16 pairs and transposed in registers, so that one vdpbf16ps multiplies a pair of
//   q's values (broadcast) with that pair of the 16 keys and adds to the 16 positions' scores: no horizontal sums,
//   and 32 products per instruction. The keys' products are exact in float32 (bf16 x bf16), only their sums round
//   (in pairs). Values stay float32 FMAs (the probabilities are not rounded to bf16), all heads' sums held in
//   registers while the position's values are widened once. A quantized cache is read where it lies the same way:
//   its codes widened to bf16 in registers (exact), each row's scale (a power of two) multiplying its key's scores
//   or its value's weights, which gives the bits of the codes times their scales.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "arch/isa.h"
#include "attention/common.h"
#include "attention/kv_quant.h"
#include "core/simd.h"

#if TM_BF16_PAIRS
#include "arch/avx512bf16/attention.h"
#else
#include "arch/generic/attention.h"
#endif

namespace tmk {

// Positions [t0, t1) of a paged context run by run within a block: fn(slot, t, m) for each run of m positions from t,
// whose slots are slot .. slot + m - 1 (position t's slot is table[t / block_size] * block_size + t % block_size)
template <typename Fn>
inline void for_each_run(const int64_t* table, int64_t block_size, int64_t t0, int64_t t1, Fn&& fn) {
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % block_size, m = std::min(block_size - off, t1 - t);
    fn(table[t / block_size] * block_size + off, t, m);
    t += m;
  }
}

// Split s of one new token's attention over its paged context, for one (sequence b, KV head g): the G query heads'
// softmax over the split's positions and their weighted sum of values. cache: [2, slots, Hkv, Dh] for this layer
// (keys then values); q: [B, H, Dh]; table: the sequence's block ids; len: its context length. -> acc [G, Dh] (the
// sums, float32) and ml [G, 2] (each head's largest score and sum of exponentials over the split), for
// merge_splits. `scratch` holds attention_scratch(G, Dh, block_size) floats. A quantized cache (C = int8_t or
// f8e4m3) comes with its scales [2, slots, Hkv] (attention/kv_quant.h).
template <typename T, typename C = T>
inline void attention_split(const T* q, const C* cache, int64_t slots, const int64_t* table, int64_t len,
                            int64_t window, int64_t b, int64_t g, int64_t s, int64_t H, int64_t Hkv, int64_t Dh,
                            int64_t block_size, float scale, float* acc, float* ml, float* scratch,
                            const uint16_t* kv_scales = nullptr) {
  const int64_t G = H / Hkv, kv_stride = Hkv * Dh;
  // positions [begin, len): the whole context, or with a window (> 0) its last `window` positions; this split's
  // are [t0, t1)
  const int64_t begin = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t t0 = begin + s * kSplit, t1 = std::min(len, t0 + kSplit), n = t1 - t0;
  if constexpr (sizeof(T) == 2 && (std::is_same_v<C, T> || kv_quantized<C>)) {
    using E = std::conditional_t<kv_quantized<C>, C, uint16_t>;
    if (attention_split_bf16((const uint16_t*)q, (const E*)cache, slots, table, t0, t1, b, g, H, G, Dh, kv_stride,
                             block_size, scale, acc, ml, scratch, kv_scales))
      return;
  }
  float* qv = scratch;            // [G, Dh]
  float* scores = qv + G * Dh;    // [G, n]
  float* run = scores + G * n;    // [<= block_size, Dh]: a run's keys or values as float32
  // this head's keys and values, asked for ahead of the runs that read them
  RowAsker ask{[&](int64_t i) {
                 const int64_t half = i >= n, t = t0 + i - half * n;
                 const int64_t slot = table[t / block_size] * block_size + t % block_size;
                 return cache + (half * slots + slot) * kv_stride + g * Dh;
               },
               2 * n, Dh * (int64_t)sizeof(C)};
  // m rows of keys (half 0) or values (1) from `slot` as float32 rows, `stride` apart. A quantized cache's rows
  // are its codes, and `row_scale` their scales: each key's scale multiplies its scores, each value's its weights.
  // The scales are powers of two (kv_quant.h), so this is exact: the same bits as the codes times their scales
  // would give, which every other path reads (as bf16 too, exactly).
  float row_scale[kSplit], weight[kSplit];
  auto rows = [&](int64_t half, int64_t slot, int64_t m, int64_t& stride) -> const float* {
    const C* src = cache + (half * slots + slot) * kv_stride + g * Dh;
    if constexpr (kv_quantized<C>) {
      stride = Dh;
      const uint16_t* sc = kv_scales + (half * slots + slot) * Hkv + g;
      for (int64_t i = 0; i < m; ++i) row_scale[i] = bf16_to_float(sc[i * Hkv]);
      return widen_quant_rows(src, kv_stride, (const uint16_t*)nullptr, 0, m, Dh, run);
    } else {
      return float_rows(src, m, stride, Dh, run);
    }
  };
  for (int64_t j = 0; j < G * Dh; ++j) qv[j] = load_one(q + (b * H + g * G) * Dh + j) * scale;
  for_each_run(table, block_size, t0, t1, [&](int64_t slot, int64_t t, int64_t m) {
    ask.until(t - t0 + m);  // this run's keys and kAskAhead more
    int64_t stride = kv_stride;
    const float* kb = rows(0, slot, m, stride);
    for (int64_t j = 0; j < G; ++j) {
      float* s = scores + j * n + t - t0;
      dot_rows(qv + j * Dh, kb, stride, m, Dh, s);
      if constexpr (kv_quantized<C>)
        for (int64_t i = 0; i < m; ++i) s[i] *= row_scale[i];
    }
  });
  ask.until(n);
  softmax_rows(scores, G, n, ml);
  std::fill(acc, acc + G * Dh, 0.f);
  for_each_run(table, block_size, t0, t1, [&](int64_t slot, int64_t t, int64_t m) {
    ask.until(n + t - t0 + m);
    int64_t stride = kv_stride;
    const float* vb = rows(1, slot, m, stride);
    for (int64_t j = 0; j < G; ++j) {
      const float* p = scores + j * n + t - t0;
      if constexpr (kv_quantized<C>) {
        for (int64_t i = 0; i < m; ++i) weight[i] = p[i] * row_scale[i];
        p = weight;
      }
      axpy_run(acc + j * Dh, p, vb, stride, m, Dh);
    }
  });
}

// A sequence's n splits of query heads [h0, h1) -> out (T [H, Dh], the sequence's row); acc [n, H, Dh] and
// ml [n, H, 2] as attention_split left them. Split s's sums weigh in with its share of the softmax's denominator,
// l_s e^(m_s - M) / L (M the largest score of all, L the sum of those terms), added in split order. One split
// weighs 1 exactly: its sums as they are. With `sinks` ([H] float32, gpt-oss), head h's sink logit joins M and adds
// e^(sink - M) to L, a term that weighs no values: then even one split is scaled.
template <typename T>
inline void merge_splits(const float* acc, const float* ml, int64_t n, int64_t H, int64_t h0, int64_t h1,
                         int64_t Dh, T* out, const float* sinks = nullptr) {
  thread_local std::vector<float> weight, sum;
  weight.resize(n), sum.resize(Dh);
  for (int64_t h = h0; h < h1; ++h) {
    float top = sinks ? sinks[h] : -INFINITY, total = 0.f;
    for (int64_t s = 0; s < n; ++s) top = std::max(top, ml[(s * H + h) * 2]);
    for (int64_t s = 0; s < n; ++s) {
      weight[s] = ml[(s * H + h) * 2 + 1] * std::exp(ml[(s * H + h) * 2] - top);
      total += weight[s];
    }
    if (sinks) total += std::exp(sinks[h] - top);
    const float* first = acc + h * Dh;
    const float* o = first;
    if (n > 1 || sinks) {
      for (int64_t d = 0; d < Dh; ++d) sum[d] = first[d] * (weight[0] / total);
      for (int64_t s = 1; s < n; ++s) {
        const float w = weight[s] / total;
        const float* a = acc + (s * H + h) * Dh;
        for (int64_t d = 0; d < Dh; ++d) sum[d] += a[d] * w;
      }
      o = sum.data();
    }
    T* dst = out + h * Dh;
    for (int64_t d = 0; d < Dh; ++d) {
      if constexpr (sizeof(T) == 2) *(uint16_t*)(dst + d) = float_to_bf16(o[d]);
      else *(float*)(dst + d) = o[d];
    }
  }
}

}  // namespace tmk
