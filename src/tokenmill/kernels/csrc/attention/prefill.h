// Prefill attention: the new tokens of every prompt (or prompt chunk) in a step over the paged KV cache, in one
// call, after their keys and values were written there.
//
// Flash style (FlashAttention's online softmax): a task is one (sequence, KV head, block of QB new tokens); its
// rows are the block's tokens times the G query heads that share the KV head, so every key and value read serves
// QB x G rows. The context passes in blocks of KB positions: each block's scores are softmaxed against a running
// maximum and sum per row, and the weighted values added to the row's running output, so no [rows, context]
// matrix exists. Everything is float32 past the products; the output rounds to the model's dtype once.
// - scores: a block's keys are packed as the linears' weight panels (linear/format.h: 16 positions side by side at each k,
//   bf16 in k pairs), so the same register tiles multiply them by the rows' queries: vdpbf16ps on AVX-512 BF16,
//   FMAs elsewhere; bf16 x bf16 products are exact in float32 either way.
// - values: widened to float32 once per block, times the float32 probabilities (not rounded to bf16: torch's
//   SDPA keeps them in float32 too; rounded, a bf16 model's outputs moved further from the exact ones, and a
//   random-weight model's greedy tokens left transformers' at the first token).
// torch's SDPA, called once per sequence, was a large share of a bf16 prefill (docs/benchmarks.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention/common.h"
#include "attention/decode.h"  // pack_keys_bf16 (this build's)
#include "attention/kv_quant.h"
#include "core/simd.h"
#include "linear/dense_tiles.h"
#include "linear/pair_tile.h"

namespace tmk {

constexpr int64_t KB = 64;          // context positions per block: KB / P panels
// rows (tokens x G heads) a task aims for: each block's keys are packed and its values widened once for them (192 on
// AVX2: 3-10% faster than 96 over 4-8k contexts, scripts/prefill_attention_ab.py on a Zen 3)
constexpr int64_t PREFILL_ROWS = W == 8 ? 192 : 96;

// register tile rows for the scores (what the linears use for the same panels) and for the weighted values
template <typename T>
constexpr int score_rows() {
  if constexpr (sizeof(T) == 2) return W == 16 ? 12 : (W == 8 ? 4 : 2);
  else return W == 4 ? 2 : (W == 8 ? 5 : 8);
}
// rows x PV_NV sums + PV_NV values + 1 broadcast fit the registers (16 of them in 8-lane builds: 6 x 2 loads 8 for
// 12 FMAs, where 2 x 4 loaded 10 for 8: its values were read from memory for each row)
constexpr int PV_NV = W == 16 ? 4 : 2;     // vectors of Dh per value tile
constexpr int PV_ROWS = 6;

struct PrefillTask {
  int64_t seq, g, i0, i1;  // sequence, KV head, new tokens [i0, i1)
  int64_t cost;            // rows x positions: the longest tasks go first
};

template <typename T, typename C = T>
struct PrefillJob {
  const T* q;                  // [tokens, H, Dh], tokens q_stride elements apart, heads Dh apart
  int64_t q_stride;
  const C* cache;              // this layer's [2, slots, Hkv, Dh]: T, or quantized (attention/kv_quant.h)
  int64_t slots;
  const int64_t* tables;       // [S, max_blocks] block ids
  int64_t max_blocks, block_size;
  const int64_t* seqs;         // [S, 3]: first row in q, new tokens, context length (new ones included)
  int64_t H, Hkv, Dh;
  float scale;
  int64_t window;              // > 0: each token sees only the last `window` positions (itself included)
  T* out;                      // [tokens, H, Dh] contiguous
  const float* sinks;          // [H]: each head's sink logit in the softmax's denominator (gpt-oss), or null
  const uint16_t* kv_scales = nullptr;  // a quantized cache's bf16 scales [2, slots, Hkv]
};

// The keys of n <= KB positions (row pointers) as ceil(n / P) panels in `panels`, zero past n: bf16 [Dh/2][P][2]
// (a pair of k is one 32-bit word), float32 [Dh][P]. With AVX-512, 16 keys of 16 bf16 pairs are transposed in
// registers (decode attention's transpose16), one panel row per pair.
template <typename T>
inline void pack_keys(const T* const* rows, int64_t n, int64_t Dh, T* panels) {
  const int64_t np = (n + P - 1) / P;
  for (int64_t p = 0; p < np; ++p) {
    const int64_t m = std::min<int64_t>(P, n - p * P);
    const T* const* key = rows + p * P;
    if constexpr (sizeof(T) == 2) {
      uint32_t* dst = (uint32_t*)(panels + p * P * Dh);  // [Dh/2][P] words
      if (pack_keys_bf16(key, m, Dh, dst)) continue;
      for (int64_t j = 0; j < Dh / 2; ++j)
        for (int64_t i = 0; i < P; ++i) {
          uint32_t word = 0;
          if (i < m) std::memcpy(&word, key[i] + 2 * j, 4);
          dst[j * P + i] = word;
        }
    } else {
      T* dst = panels + p * P * Dh;
      for (int64_t d = 0; d < Dh; ++d)
        for (int64_t i = 0; i < P; ++i) dst[d * P + i] = i < m ? key[i][d] : T(0);
    }
  }
}

// s[m][0..P) = scale * (row m of q) . (the panel's P keys), for MT rows of q (Dh apart): bf16 keys against bf16
// queries in vdpbf16ps pairs where the CPU has it, else against the queries widened to float32 (qf), as the linears
// take their activations (the same products, in the same order: even k, then odd)
template <typename T, int MT>
inline void score_tile(const T* panel, const T* q, const float* qf, int64_t Dh, float scale, float* s, int64_t lds) {
  vf acc[1][MT][V] = {};  // (the keys are in L1: no prefetch)
  if constexpr (sizeof(T) == 2 && TM_BF16_PAIRS)
    tile_bf16_pairs<MT, 1>((const uint16_t*)panel, (const uint16_t*)q, Dh, Dh, acc[0]);
  else if constexpr (sizeof(T) == 2) span_dense<MT, 1, false, uint16_t>((const uint16_t*)panel, qf, Dh, 0, Dh / 2, acc);
  else tile_dense<MT, 1, float>((const float*)panel, (const float*)q, Dh, Dh, acc[0]);
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < V; ++v) store(s + m * lds + v * W, acc[0][m][v] * splat(scale));
}

// o[m][d0 .. d0 + NV W) += sum over j < n of p[m][j] * values[j][d0 ..], for MT rows (o rows Dh apart)
template <int MT, int NV>
inline void value_tile(const float* p, int64_t ldp, int64_t n, const float* values, int64_t Dh, int64_t d0, float* o) {
  vf a[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) a[m][v] = load(o + m * Dh + d0 + v * W);
  for (int64_t j = 0; j < n; ++j) {
    vf x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load(values + j * Dh + d0 + v * W);
    for (int m = 0; m < MT; ++m) {
      const vf w = splat(p[m * ldp + j]);
      for (int v = 0; v < NV; ++v) a[m][v] += w * x[v];
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) store(o + m * Dh + d0 + v * W, a[m][v]);
}

// One row's scores s[lo, hi) (the positions it sees in this block of n) -> probabilities against its running
// maximum mx and sum l, in place, 0 outside [lo, hi); returns the factor its earlier sums must be scaled by.
inline float online_softmax_row(float* s, int64_t n, int64_t lo, int64_t hi, float& mx, float& l) {
  if (hi <= lo) {
    std::fill(s, s + n, 0.f);
    return 1.f;
  }
  vf tops = splat(-INFINITY);
  int64_t j = lo;
  for (; j + W <= hi; j += W) {
    const vf v = load(s + j);
    tops = v > tops ? v : tops;
  }
  float top = hmax(tops);
  for (; j < hi; ++j) top = std::max(top, s[j]);
  // the maximum mostly stands after a row's first blocks: e^0 = 1 without the call
  const float m_new = std::max(mx, top), corr = mx == m_new ? 1.f : mx == -INFINITY ? 0.f : std::exp(mx - m_new);
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + n, 0.f);
  vf sums = {};
  constexpr float LOG2E = 1.44269504088896341f;  // e^(s - m) = 2^(s log2 e - m log2 e), the argument in one FMA
  const vf k = splat(LOG2E), shift = splat(-m_new * LOG2E);
  for (j = lo; j + W <= hi; j += W) {
    const vf e = exp2_neg(load(s + j) * k + shift);
    store(s + j, e);
    sums += e;
  }
  float sum = hsum(sums);
  for (; j < hi; ++j) sum += (s[j] = std::exp(s[j] - m_new));
  l = l * corr + sum, mx = m_new;
  return corr;
}

// bf16 queries are widened to float32 once per task where the score tiles take float32 activations
template <typename T>
constexpr bool widens_q() { return sizeof(T) == 2 && !TM_BF16_PAIRS; }

// Per-thread buffers of a task with up to `rows` rows.
template <typename T>
struct PrefillScratch {
  std::vector<T> q, keys, widened;         // [rows, Dh]; [KB, Dh] packed; [KB, Dh] a quantized cache's keys as T
  std::vector<float> qf, values, s, o, mx, l;  // [rows, Dh] q widened (bf16 without vdpbf16ps); [KB, Dh]; [rows, KB];
                                               // [rows, Dh]; [rows]; [rows]
  std::vector<const T*> krow;              // [KB]
  PrefillScratch(int64_t rows, int64_t Dh)
      : q(rows * Dh), keys(KB * Dh), widened(KB * Dh), qf(widens_q<T>() ? rows * Dh : 0), values(KB * Dh),
        s(rows * KB), o(rows * Dh), mx(rows), l(rows), krow(KB) {}
};

// The rows [first row's position + r / G] of a task, and the positions each sees.
struct TaskRows {
  int64_t first, G, window;
  int64_t pos(int64_t r) const { return first + r / G; }
};

// s[r][0..n) = scaled scores of every row against the block's packed keys at t0 (panels no row of a tile sees
// are skipped: their entries are not read)
template <typename T>
void block_scores(const PrefillScratch<T>& sc, float* s, int64_t R, int64_t n, int64_t t0, const TaskRows& tr,
                  int64_t Dh, float scale) {
  constexpr int MT = score_rows<T>();
  for (int64_t r0 = 0; r0 < R; r0 += MT) {
    const int64_t rows = std::min<int64_t>(MT, R - r0), last = tr.pos(r0 + rows - 1), earliest = tr.pos(r0);
    for (int64_t p = 0; p * P < n && t0 + p * P <= last; ++p) {
      if (tr.window > 0 && t0 + p * P + P - 1 < earliest - tr.window + 1) continue;  // before every row's window
      with_rows<MT>(rows, [&](auto r) {
        score_tile<T, decltype(r)::value>(sc.keys.data() + p * P * Dh, sc.q.data() + r0 * Dh,
                                          sc.qf.data() + (widens_q<T>() ? r0 * Dh : 0), Dh, scale,
                                          s + r0 * KB + p * P, KB);
      });
    }
  }
}

// o[r] += p[r] . values for every row: float32 FMAs over the values widened once per block
template <typename T>
void block_values(PrefillScratch<T>& sc, int64_t R, int64_t n, int64_t Dh) {
  for (int64_t r0 = 0; r0 < R; r0 += PV_ROWS)
    with_rows<PV_ROWS>(std::min<int64_t>(PV_ROWS, R - r0), [&](auto rows) {
      constexpr int M = decltype(rows)::value;
      const float* p = sc.s.data() + r0 * KB;
      float* o = sc.o.data() + r0 * Dh;
      int64_t d = 0;
      for (; d + PV_NV * W <= Dh; d += PV_NV * W) value_tile<M, PV_NV>(p, KB, n, sc.values.data(), Dh, d, o);
      for (; d < Dh; d += W) value_tile<M, 1>(p, KB, n, sc.values.data(), Dh, d, o);
    });
}

// The keys of positions [t0, t0 + n) of KV head g as row pointers in sc.krow, their values as float32 rows in
// sc.values: a T cache's keys where they lie; a quantized cache's widened into sc.widened (rounded to T, as the tiles
// multiply T keys), its values widened exactly.
template <typename T, typename C>
void block_rows(const PrefillJob<T, C>& job, int64_t g, const int64_t* table, int64_t t0, int64_t n,
                PrefillScratch<T>& sc) {
  const int64_t Dh = job.Dh, kv_stride = job.Hkv * Dh;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i, slot = table[t / job.block_size] * job.block_size + t % job.block_size;
    const C* key = job.cache + slot * kv_stride + g * Dh;
    float* value = sc.values.data() + i * Dh;
    if constexpr (kv_quantized<C>) {
      const int64_t at = slot * job.Hkv + g;
      const float* row = widen_quant_rows(key, 0, job.kv_scales + at, 0, 1, Dh, value);  // the key, for a moment
      T* dst = sc.widened.data() + i * Dh;
      for (int64_t d = 0; d < Dh; d += W) {
        if constexpr (sizeof(T) == 2) store_bf16((uint16_t*)(dst + d), load(row + d));
        else store((float*)(dst + d), load(row + d));
      }
      sc.krow[i] = dst;
      // (exact in bf16: kv_quant.h's power-of-two scales)
      widen_quant_rows(key + job.slots * kv_stride, 0, job.kv_scales + job.slots * job.Hkv + at, 0, 1, Dh, value);
    } else {
      sc.krow[i] = key;
      for (int64_t d = 0; d < Dh; d += W) store(value + d, load_row(key + job.slots * kv_stride + d));
    }
  }
}

// The cache lines of the keys and values of positions [t0, t0 + n) of KV head g, asked into L2 while the block
// before them is computed (rows of the paged cache are read once per task, and waited on otherwise)
template <typename T, typename C>
void prefetch_block(const PrefillJob<T, C>& job, int64_t g, const int64_t* table, int64_t t0, int64_t n) {
  const int64_t kv_stride = job.Hkv * job.Dh, bytes = job.Dh * (int64_t)sizeof(C);
  for (int64_t t = t0; t < t0 + n; ++t) {
    const C* key = job.cache + (table[t / job.block_size] * job.block_size + t % job.block_size) * kv_stride + g * job.Dh;
    prefetch_range_l2(key, bytes);
    prefetch_range_l2(key + job.slots * kv_stride, bytes);
  }
}

// A task's rows out: each row's float32 sums o [R, Dh] over its sum of exponentials l (and a sink's share of it),
// rounded to the model's dtype once, into its token's head
template <typename T, typename C>
void finish_rows(const PrefillJob<T, C>& job, const PrefillTask& task, const float* o, const float* mx, const float* l) {
  const int64_t G = job.H / job.Hkv, Dh = job.Dh, R = (task.i1 - task.i0) * G, row0 = job.seqs[task.seq * 3];
  for (int64_t r = 0; r < R; ++r) {
    T* dst = job.out + ((row0 + task.i0 + r / G) * job.H + task.g * G + r % G) * Dh;
    float inv = 1.f / l[r];
    if (job.sinks) {  // the sink's e^(sink - M) joins the sum of exponentials, against the larger of the two maxima
      const float sink = job.sinks[task.g * G + r % G], top = std::max(mx[r], sink), corr = std::exp(mx[r] - top);
      inv = corr / (l[r] * corr + std::exp(sink - top));
    }
    for (int64_t d = 0; d < Dh; ++d) {
      const float y = o[r * Dh + d] * inv;
      if constexpr (sizeof(T) == 2) *(uint16_t*)(dst + d) = float_to_bf16(y);
      else dst[d] = y;
    }
  }
}

// One task: its rows' queries copied side by side, then the context block by block, then the rows normalized out.
template <typename T, typename C>
void prefill_task(const PrefillJob<T, C>& job, const PrefillTask& task, PrefillScratch<T>& sc) {
  const int64_t G = job.H / job.Hkv, Dh = job.Dh, R = (task.i1 - task.i0) * G, kv_stride = job.Hkv * Dh;
  const int64_t* seq = job.seqs + task.seq * 3;
  const int64_t* table = job.tables + task.seq * job.max_blocks;
  const int64_t row0 = seq[0];  // q row of new token 0, at position seq[2] - seq[1]
  const TaskRows tr{seq[2] - seq[1] + task.i0, G, job.window};
  const int64_t kend = tr.pos(R - 1) + 1, kbeg = job.window > 0 ? std::max<int64_t>(0, tr.pos(0) - job.window + 1) : 0;
  for (int64_t i = task.i0; i < task.i1; ++i)
    std::copy_n(job.q + (row0 + i) * job.q_stride + task.g * G * Dh, G * Dh, sc.q.data() + (i - task.i0) * G * Dh);
  if constexpr (widens_q<T>())
    for (int64_t i = 0; i < R * Dh; i += W) store(sc.qf.data() + i, load_row(sc.q.data() + i));
  std::fill_n(sc.o.data(), R * Dh, 0.f);
  std::fill_n(sc.mx.data(), R, -INFINITY);
  std::fill_n(sc.l.data(), R, 0.f);
  for (int64_t t0 = kbeg; t0 < kend; t0 += KB) {
    const int64_t n = std::min(KB, kend - t0);
    if (t0 + KB < kend) prefetch_block(job, task.g, table, t0 + KB, std::min(KB, kend - t0 - KB));
    block_rows(job, task.g, table, t0, n, sc);
    pack_keys(sc.krow.data(), n, Dh, sc.keys.data());
    block_scores(sc, sc.s.data(), R, n, t0, tr, Dh, job.scale);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = tr.pos(r), hi = std::min(n, at - t0 + 1);
      const int64_t lo = job.window > 0 ? std::clamp<int64_t>(at - job.window + 1 - t0, 0, n) : 0;
      const float corr = online_softmax_row(sc.s.data() + r * KB, n, lo, hi, sc.mx[r], sc.l[r]);
      if (corr != 1.f)
        for (int64_t d = 0; d < Dh; ++d) sc.o[r * Dh + d] *= corr;
    }
    block_values(sc, R, n, Dh);
  }
  finish_rows(job, task, sc.o.data(), sc.mx.data(), sc.l.data());
}

}  // namespace tmk
