// Prefill attention on AMX tiles for a bf16 model (arch/amx/amx_attention.h), where the CPU and Linux allow them and
// Dh is a multiple of 32: the task of attention/prefill.h (its rows, its blocks of KB positions, its online softmax,
// its float32 outputs) with the scores and the weighted values each a few tile products a block, where the vector
// tiles took most of the time (a prefill of thousands of tokens over a long context is these two products).
// - The rows are padded to a multiple of 32 (two tiles of 16): a pad row's sums are computed and never read.
// - A block's keys are the same packed panels; its values become pairs of positions; the probabilities two bf16 parts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention/prefill.h"
#include "linear/amx.h"  // use_amx: the process's switch

#if TM_AMX
#include "arch/amx/amx_attention.h"
#endif

namespace tmk {

// Rows a task aims for on AMX (a multiple of 32 after padding), and context positions per block: twice the vector
// tiles' of each. A block's keys and values are packed once for all the rows, and each row's softmax pays its
// reductions once a block; 192 x 128 was 7-15% faster than 96 x 64 (scripts/prefill_attention_ab.py, a Xeon).
constexpr int64_t AMX_PREFILL_ROWS = 192;
constexpr int64_t AKB = 128;

// this job's tasks run on AMX: a bf16 model (either cache type), tiles allowed, whole 32-wide steps of Dh
template <typename T>
inline bool amx_prefill(int64_t Dh) {
  return sizeof(T) == 2 && TM_AMX && use_amx() && Dh % 32 == 0;
}

// Per-thread buffers of an AMX task with up to `rows` rows (padded to `padded`, a multiple of 32).
struct AmxPrefillScratch {
  // [padded, Dh]; [AKB, Dh] packed; [AKB, Dh] paired; [2, AKB, Dh] a quantized cache's rows as bf16; [padded, AKB]
  std::vector<uint16_t> q, keys, pairs, widened, hi, lo;
  std::vector<float> s, o, mx, l, row;  // [padded, AKB]; [padded, Dh]; [rows]; [rows]; [Dh] a widened row
  std::vector<const uint16_t*> krow, vrow;  // [AKB]
  AmxPrefillScratch(int64_t rows, int64_t padded, int64_t Dh)
      : q(padded * Dh), keys(AKB * Dh), pairs(AKB * Dh), widened(2 * AKB * Dh), hi(padded * AKB), lo(padded * AKB),
        s(padded * AKB), o(padded * Dh), mx(rows), l(rows), row(Dh), krow(AKB), vrow(AKB) {}
};

// The keys and values of positions [t0, t0 + n) of KV head g as bf16 row pointers (a quantized cache's widened, as
// prefill.h's block_rows widens them), then the values paired and the keys packed.
template <typename T, typename C>
void amx_block_rows(const PrefillJob<T, C>& job, int64_t g, const int64_t* table, int64_t t0, int64_t n,
                    AmxPrefillScratch& sc) {
  const int64_t Dh = job.Dh, kv_stride = job.Hkv * Dh;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = t0 + i, slot = table[t / job.block_size] * job.block_size + t % job.block_size;
    const C* key = job.cache + slot * kv_stride + g * Dh;
    if constexpr (kv_quantized<C>) {
      const int64_t at = slot * job.Hkv + g;
      const uint16_t* scales[2] = {job.kv_scales + at, job.kv_scales + job.slots * job.Hkv + at};
      for (int kv = 0; kv < 2; ++kv) {  // (exact in bf16: kv_quant.h's power-of-two scales)
        const float* wide = widen_quant_rows(key + kv * job.slots * kv_stride, 0, scales[kv], 0, 1, Dh, sc.row.data());
        uint16_t* dst = sc.widened.data() + (kv * AKB + i) * Dh;
        for (int64_t d = 0; d < Dh; d += W) store_bf16(dst + d, load(wide + d));
        (kv ? sc.vrow : sc.krow)[i] = dst;
      }
    } else {
      sc.krow[i] = (const uint16_t*)key;
      sc.vrow[i] = (const uint16_t*)(key + job.slots * kv_stride);
    }
  }
  amx_pair_values(sc.vrow.data(), n, Dh, sc.pairs.data());
  pack_keys<uint16_t>(sc.krow.data(), n, Dh, sc.keys.data());
}

template <typename T, typename C>
void prefill_task_amx(const PrefillJob<T, C>& job, const PrefillTask& task, AmxPrefillScratch& sc) {
  const int64_t G = job.H / job.Hkv, Dh = job.Dh, R = (task.i1 - task.i0) * G, padded = (R + 31) / 32 * 32;
  const int64_t* seq = job.seqs + task.seq * 3;
  const int64_t* table = job.tables + task.seq * job.max_blocks;
  const TaskRows tr{seq[2] - seq[1] + task.i0, G, job.window};
  const int64_t kend = tr.pos(R - 1) + 1, kbeg = job.window > 0 ? std::max<int64_t>(0, tr.pos(0) - job.window + 1) : 0;
  for (int64_t i = task.i0; i < task.i1; ++i)
    std::copy_n((const uint16_t*)(job.q + (seq[0] + i) * job.q_stride + task.g * G * Dh), G * Dh,
                sc.q.data() + (i - task.i0) * G * Dh);
  std::fill_n(sc.o.data(), padded * Dh, 0.f);
  std::fill_n(sc.mx.data(), R, -INFINITY);
  std::fill_n(sc.l.data(), R, 0.f);
  for (int64_t t0 = kbeg / AKB * AKB; t0 < kend; t0 += AKB) {
    const int64_t n = std::min(AKB, kend - t0);
    if (t0 + AKB < kend) prefetch_block(job, task.g, table, t0 + AKB, std::min(AKB, kend - t0 - AKB));
    amx_block_rows(job, task.g, table, t0, n, sc);
    const int64_t panels = ((n + P - 1) / P + 1) / 2 * 2;
    amx_attention_scores(sc.q.data(), padded, Dh, sc.keys.data(), panels, sc.s.data(), AKB);
    const int64_t width = (n + 31) / 32 * 32;  // the positions the values' product takes
    for (int64_t r = 0; r < R; ++r) {
      const int64_t at = tr.pos(r), hi = std::min(n, at - t0 + 1);
      const int64_t lo = job.window > 0 ? std::clamp<int64_t>(at - job.window + 1 - t0, 0, n) : 0;
      const float corr = amx_softmax_row(sc.s.data() + r * AKB, width, lo, hi, job.scale, sc.mx[r], sc.l[r],
                                         sc.hi.data() + r * AKB, sc.lo.data() + r * AKB);
      float* o = sc.o.data() + r * Dh;
      if (corr != 1.f)
        for (int64_t d = 0; d < Dh; d += W) store(o + d, load(o + d) * splat(corr));
    }
    amx_attention_values(sc.hi.data(), sc.lo.data(), AKB, padded, width / 32, sc.pairs.data(), Dh, sc.o.data());
  }
  finish_rows(job, task, sc.o.data(), sc.mx.data(), sc.l.data());
}

}  // namespace tmk
