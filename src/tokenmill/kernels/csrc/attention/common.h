// What decode and prefill attention share: a cache row's values as floats, dot products and weighted sums over
// rows, the splits of a context, the softmax of a split's scores, and asking for a split's rows ahead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/cpu.h"
#include "core/simd.h"

namespace tmk {

// W lanes of a row of T (bfloat16 as uint16_t, or float) as floats
template <typename T>
inline vf load_row(const T* p) {
  if constexpr (sizeof(T) == 2) return load_bf16((const uint16_t*)p);
  else return load((const float*)p);
}

template <typename T>
inline float load_one(const T* p) {
  if constexpr (sizeof(T) == 2) return bf16_to_float(*(const uint16_t*)p);
  else return *(const float*)p;
}

// dot(a[0..Dh), row[0..Dh)) with a in float32 and the row in T
template <typename T>
inline float dot_row(const float* a, const T* row, int64_t Dh) {
  vf s = {};
  int64_t i = 0;
  for (; i + W <= Dh; i += W) s += load(a + i) * load_row(row + i);
  float r = hsum(s);
  for (; i < Dh; ++i) r += a[i] * load_one(row + i);
  return r;
}

// out[i] = dot(a[0..Dh), rows[i * stride ..]) for i < n (float32 rows): four rows at a time share a's loads and
// one shuffle tree for their sums
inline void dot_rows(const float* a, const float* rows, int64_t stride, int64_t n, int64_t Dh, float* out) {
  int64_t i = 0;
  if (Dh % W == 0)
    for (; i + 4 <= n; i += 4) {
      vf s[4] = {};
      for (int64_t d = 0; d < Dh; d += W) {
        const vf av = load(a + d);
        for (int r = 0; r < 4; ++r) s[r] += av * load(rows + (i + r) * stride + d);
      }
      hsum4(s[0], s[1], s[2], s[3], out + i);
    }
  for (; i < n; ++i) out[i] = dot_row(a, rows + i * stride, Dh);
}

// acc[0..NV W) += sum over i < n of p[i] * rows[i * stride ..]: the NV accumulators stay in registers across the
// rows (position by position, as one axpy per row would add them)
template <int NV>
inline void axpy_rows(float* acc, const float* p, const float* rows, int64_t stride, int64_t n) {
  vf a[NV];
  for (int v = 0; v < NV; ++v) a[v] = load(acc + v * W);
  for (int64_t i = 0; i < n; ++i) {
    const vf pv = splat(p[i]);
    for (int v = 0; v < NV; ++v) a[v] += pv * load(rows + i * stride + v * W);
  }
  for (int v = 0; v < NV; ++v) store(acc + v * W, a[v]);
}

// acc[0..Dh) += sum over i < n of p[i] * rows[i * stride + 0..Dh)
inline void axpy_run(float* acc, const float* p, const float* rows, int64_t stride, int64_t n, int64_t Dh) {
  int64_t d = 0;
  for (; d + 4 * W <= Dh; d += 4 * W) axpy_rows<4>(acc + d, p, rows + d, stride, n);
  for (; d + W <= Dh; d += W) axpy_rows<1>(acc + d, p, rows + d, stride, n);
  for (; d < Dh; ++d)
    for (int64_t i = 0; i < n; ++i) acc[d] += p[i] * rows[i * stride + d];
}

// n cache rows of Dh values (src, `stride` elements apart) as float32: a float cache in place; bf16 widened into
// buf [n, Dh] once, for all G query heads. Sets `stride` to the returned rows' stride.
template <typename T>
inline const float* float_rows(const T* src, int64_t n, int64_t& stride, int64_t Dh, float* buf) {
  if constexpr (sizeof(T) == 4) {
    return (const float*)src;
  } else {
    for (int64_t i = 0; i < n; ++i) {
      int64_t d = 0;
      for (; d + W <= Dh; d += W) store(buf + i * Dh + d, load_row(src + i * stride + d));
      for (; d < Dh; ++d) buf[i * Dh + d] = load_one(src + i * stride + d);
    }
    stride = Dh;
    return buf;
  }
}

// Positions per split. A sequence's context is cut into splits of this many positions (counted from the first
// position it attends to), each split's softmax and weighted sum of values taken on their own, then merged in split
// order (merge_splits). A fixed number, so that a sequence's result depends on its own length only: not on the batch
// around it, the number of threads, or which thread merges.
constexpr int64_t kSplit = 128;

// the splits of a sequence of `len` positions that attends to all of them, or with a window (> 0) to its last `window`
inline int64_t num_splits(int64_t len, int64_t window) {
  const int64_t n_ctx = window > 0 ? std::min(len, window) : len;
  return std::max<int64_t>(1, (n_ctx + kSplit - 1) / kSplit);
}

// B sequences' splits numbered in sequence order: sequence b's are [first[b], first[b + 1]) (first: B + 1 entries)
inline void split_offsets(const int64_t* len, int64_t B, int64_t window, std::vector<int64_t>& first) {
  first.resize(B + 1), first[0] = 0;
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + num_splits(len[b], window);
}

// the sequence that split `split` belongs to, in split_offsets' numbering
inline int64_t split_owner(const std::vector<int64_t>& first, int64_t split) {
  return std::upper_bound(first.begin(), first.end(), split) - first.begin() - 1;
}

// floats of scratch attention_split needs for G query heads of Dh (blocks of block_size)
inline int64_t attention_scratch(int64_t G, int64_t Dh, int64_t block_size) {
  const int64_t n = kSplit;
  return G * (Dh + n) + std::max(std::min(block_size, n) * Dh, 2 * n + 1);
}

// scores [G, n] -> softmax along each row, in place; ml [G, 2]: each row's largest score and its sum of exponentials
// (the sum before the division)
inline void softmax_rows(float* scores, int64_t G, int64_t n, float* ml) {
  for (int64_t j = 0; j < G; ++j) {
    float* sc = scores + j * n;
    int64_t t = 0;
    vf top = splat(-INFINITY);
    for (; t + W <= n; t += W) {
      const vf v = load(sc + t);
      top = v > top ? v : top;
    }
    float mx = -INFINITY;
    for (int i = 0; i < W; ++i) mx = std::max(mx, top[i]);
    for (; t < n; ++t) mx = std::max(mx, sc[t]);
    vf sums = {};
    for (t = 0; t + W <= n; t += W) {
      const vf e = exp_neg(load(sc + t) - splat(mx));
      store(sc + t, e);
      sums += e;
    }
    float sum = hsum(sums);
    for (; t < n; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    ml[2 * j] = mx, ml[2 * j + 1] = sum;
    const vf inv = splat(1.0f / sum);
    for (t = 0; t + W <= n; t += W) store(sc + t, load(sc + t) * inv);
    for (; t < n; ++t) sc[t] *= inv[0];
  }
}

// A split's 2n cache rows (its keys, rows [0, n), then its values, [n, 2n)) asked for into L2 a fixed distance
// ahead of where the scores and sums read them: until(i) when the rows before i are about to be read. A context's
// blocks lie anywhere in the cache, where the hardware prefetcher does not follow them. Asked for all at once at the
// split's start, the rows had the core wait until the last request was on its way before any arithmetic began.
constexpr int64_t kAskAhead = 32;  // positions

template <typename RowAt>
struct RowAsker {
  RowAt at;                 // at(i): row i's first element
  int64_t rows, bytes;      // 2n rows of `bytes` each
  int64_t asked = 0;
  void until(int64_t i) {
    const int64_t upto = std::min(i + kAskAhead, rows);
    for (; asked < upto; ++asked) prefetch_range_l2(at(asked), bytes);
  }
};
template <typename RowAt>
RowAsker(RowAt, int64_t, int64_t) -> RowAsker<RowAt>;

}  // namespace tmk
