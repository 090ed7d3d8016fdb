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
  const int64_t* a;       // [slots] pointers to each adapter's A [r, K]
  const int64_t* bt;      // [slots] pointers to each adapter's B^T in panels [ceil(N / 16), r, 16]
  const int64_t* ranks;   // [slots]
  const float* scales;    // [slots]
  bool bf16 = false;      // A and B^T are bfloat16 (a bfloat16 model's: half the bytes a step reads), else float32
};

// rows of x taking one adapter at most at a time (a run of a sequence's rows, or a decode step's rows of one adapter)
constexpr int64_t kLoraRows = 16;

// xa [n, r] = scale * A x_i for n rows of x that take slot `slot` (row i at x.ptr + at(i) * ldx elements, at(i) =
// idx ? idx[i] : i; K values of the model dtype); returns r. Each A row is read once for the n rows; each (row, j)'s
// sum is that row's alone.
inline int64_t lora_xa(Act x, int64_t ldx, const int64_t* idx, int64_t n, int64_t K, int64_t slot, const LoraSlots& s,
                       float* xa) {
  thread_local std::vector<float> xf;
  xf.resize(n * K);
  const int64_t r = s.ranks[slot];
  const Act a{(void*)s.a[slot], s.bf16};
  for (int64_t i = 0; i < n; ++i) {
    const Act row{(char*)x.ptr + (idx ? idx[i] : i) * ldx * (x.bf16 ? 2 : 4), x.bf16};
    int64_t k = 0;
    for (; k + W <= K; k += W) store(xf.data() + i * K + k, row.getv(k));
    for (; k < K; ++k) xf[i * K + k] = row.get(k);
  }
  for (int64_t j = 0; j < r; ++j)
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = xf.data() + i * K;
      vf acc = {};
      int64_t k = 0;
      for (; k + W <= K; k += W) acc += a.getv(j * K + k) * load(xi + k);
      float sum = hsum(acc);
      for (; k < K; ++k) sum += a.get(j * K + k) * xi[k];
      xa[i * r + j] = sum * s.scales[slot];
    }
  return r;
}

// B^T's panels: each 16 columns' r rows side by side ([ceil(N / 16), r, 16], zero past N), so the r values a column
// sums over lie in 16 consecutive rows of 64 bytes rather than r rows N floats apart
constexpr int64_t kLoraPanel = 16;
inline int64_t lora_b(int64_t r, int64_t j, int64_t n) {  // B^T[j][n]'s index
  return ((n / kLoraPanel) * r + j) * kLoraPanel + n % kLoraPanel;
}

// R rows' sums over W columns from m: acc[i] = sum_j xa_i[j] * B^T[j][m..], in rank order from 0 (one FMA each)
template <int R>
inline void lora_columns(const float* xa, int64_t r, Act bt, int64_t m, vf* out) {
  vf acc[R];  // (in registers: a store through `out` could alias the loads)
  for (int i = 0; i < R; ++i) acc[i] = splat(0.f);
  for (int64_t j = 0; j < r; ++j) {
    const vf b = bt.getv(lora_b(r, j, m));
    for (int i = 0; i < R; ++i) acc[i] += splat(xa[i * r + j]) * b;
  }
  for (int i = 0; i < R; ++i) out[i] = acc[i];
}

// For n rows: out_i[n0, n1) += sum_j xa_i[j] * B^T[j][n0, n1), each column's sum in rank order from 0, added to out
// once (bt: B^T's panels, lora_b; out_i at out.ptr + at(i) * N elements, as lora_xa's rows). Rows go 4 at a time, their
// sums in registers, so a B^T slice is read once for them. A column's sum is the same whatever range it is asked in
// (the tail is contracted to an FMA as the lanes are: -ffp-contract=fast), so the decode stack, which adds a linear
// chunk's columns (stack/lora.h), and lora_rows give the same bits.
inline void lora_out(const float* xa, int64_t r, const int64_t* idx, int64_t n, Act bt, int64_t N, Act out, int64_t n0,
                     int64_t n1) {
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int64_t rows = std::min<int64_t>(4, n - i0);
    Act o[4];
    for (int64_t i = 0; i < rows; ++i)
      o[i] = Act{(char*)out.ptr + (idx ? idx[i0 + i] : i0 + i) * N * (out.bf16 ? 2 : 4), out.bf16};
    const float* x = xa + i0 * r;
    int64_t m = n0;
    for (; m + W <= n1; m += W) {  // (the lanes round as `set` does)
      vf acc[4];
      switch (rows) {
        case 4: lora_columns<4>(x, r, bt, m, acc); break;
        case 3: lora_columns<3>(x, r, bt, m, acc); break;
        case 2: lora_columns<2>(x, r, bt, m, acc); break;
        default: lora_columns<1>(x, r, bt, m, acc);
      }
      for (int64_t i = 0; i < rows; ++i) o[i].setv(m, o[i].getv(m) + acc[i]);
    }
    for (; m < n1; ++m)
      for (int64_t i = 0; i < rows; ++i) {
        float acc = 0.f;
        for (int64_t j = 0; j < r; ++j) acc = acc + x[i * r + j] * bt.get(lora_b(r, j, m));
        o[i].set(m, o[i].get(m) + acc);
      }
  }
}

// rows [t0, t1) of x [T, K] (model dtype, ldx elements apart) -> their updates added into out [T, N] (contiguous),
// runs of up to kLoraRows rows of one slot at a time
inline void lora_rows(Act x, int64_t ldx, Act out, int64_t N, int64_t K, const int64_t* ids, const LoraSlots& s,
                      int64_t t0, int64_t t1) {
  thread_local std::vector<float> xa;
  for (int64_t t = t0, end; t < t1; t = end) {
    const int64_t slot = ids[t];
    for (end = t + 1; end < t1 && end - t < kLoraRows && ids[end] == slot;) ++end;
    if (slot < 0) continue;
    xa.resize((end - t) * s.ranks[slot]);
    const Act rows{(char*)x.ptr + t * ldx * (x.bf16 ? 2 : 4), x.bf16};
    const int64_t r = lora_xa(rows, ldx, nullptr, end - t, K, slot, s, xa.data());
    const Act o{(char*)out.ptr + t * N * (out.bf16 ? 2 : 4), out.bf16};
    lora_out(xa.data(), r, nullptr, end - t, Act{(void*)s.bt[slot], s.bf16}, N, o, 0, N);
  }
}

}  // namespace tmk
