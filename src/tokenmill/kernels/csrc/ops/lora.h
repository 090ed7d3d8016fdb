// LoRA updates beside a projection's output (models/lora.py): out[t] += scale_a * B_a (A_a x[t]) for each row t
// whose adapter a = ids[t] is not -1; rows of the base model are left alone. A_a is float32 [r_a, K] and B_a is kept
// transposed, float32 [r_a, N], so both products stream their rows: r_a dot products over x, then r_a axpys into a
// float32 row of N, added to `out` (the model dtype) once. Each row is computed on its own: its bits do not depend
// on the batch around it or on which adapters the other rows take.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/simd.h"
#include "ops/fused.h"

namespace tmk {

struct LoraSlots {
  const int64_t* a;       // [slots] pointers to each adapter's A, float32 [r, K]
  const int64_t* bt;      // [slots] pointers to each adapter's B transposed, float32 [r, N]
  const int64_t* ranks;   // [slots]
  const float* scales;    // [slots]
};

// row x (K values, the model dtype) taking slot `slot` -> its update added into out's columns [n0, n1) (of N).
// Each column's sum is the same whatever range it is asked in (one FMA per rank, in rank order): the decode stack
// adds a row's update in parts (stack/lora.h), the per-module path in one call, and both give the same bits.
inline void lora_row(Act x, Act out, int64_t N, int64_t K, int64_t slot, const LoraSlots& s, int64_t n0, int64_t n1) {
  thread_local std::vector<float> xf, xa, y;
  xf.resize(K), y.resize(N);
  const int64_t r = s.ranks[slot];
  const float* a = (const float*)s.a[slot];
  const float* bt = (const float*)s.bt[slot];
  xa.resize(r);
  for (int64_t k = 0; k < K; ++k) xf[k] = x.get(k);
  for (int64_t j = 0; j < r; ++j) {  // xa = A x
    vf acc = {};
    int64_t k = 0;
    for (; k + W <= K; k += W) acc += load(a + j * K + k) * load(xf.data() + k);
    float sum = hsum(acc);
    for (; k < K; ++k) sum += a[j * K + k] * xf[k];
    xa[j] = sum * s.scales[slot];
  }
  std::fill(y.begin() + n0, y.begin() + n1, 0.f);
  for (int64_t j = 0; j < r; ++j) {  // y = B xa, a row of B^T at a time
    const vf w = splat(xa[j]);
    const float* b = bt + j * N;
    int64_t n = n0;
    for (; n + W <= n1; n += W) store(y.data() + n, load(y.data() + n) + w * load(b + n));
    for (; n < n1; ++n) y[n] = y[n] + xa[j] * b[n];  // contracted as the lanes are (-ffp-contract=fast)
  }
  for (int64_t n = n0; n < n1; ++n) out.set(n, out.get(n) + y[n]);
}

// rows [t0, t1) of x [T, K] (model dtype, ldx elements apart) -> their updates added into out [T, N] (contiguous)
inline void lora_rows(Act x, int64_t ldx, Act out, int64_t N, int64_t K, const int64_t* ids, const LoraSlots& s,
                      int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    if (ids[t] < 0) continue;
    const Act row{(char*)x.ptr + t * ldx * (x.bf16 ? 2 : 4), x.bf16};
    const Act o{(char*)out.ptr + t * N * (out.bf16 ? 2 : 4), out.bf16};
    lora_row(row, o, N, K, ids[t], s, 0, N);
  }
}

}  // namespace tmk
