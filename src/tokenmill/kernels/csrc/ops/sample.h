// Drawn tokens in one call: per row, the logits over the temperature, then top-k, top-p and min-p, then an
// inverse-transform draw at the row's uniform number. The rules are sampling/sampler.py's, which stays the
// reference and the path off the CPU. There the same step took a partial sort per row (`torch.topk`; a whole sort
// where a wide nucleus passes its candidates) and ~30 small torch ops, each cold after a decode step's weights had
// streamed through the caches: milliseconds a step.
// Here a row takes a few passes over its values:
// - top-k: the k-th largest value (ties counted), from a heap of the k largest, where a vector of values is looked
//   at one by one only if one of them passes the heap's least (nth_element for k > kHeapMax); what follows then
//   looks at the tokens it keeps alone (draw_kept);
// - top-p: each kept token's weight e^(x - max), summed in float64 into bins of (max - x), 1/kBinsPerUnit wide (the
//   last bin takes everything lower); the bin where the running mass reaches top_p of the total is sorted alone
//   and walked a value at a time to the nucleus's last one;
// - min-p: x >= max + log(min_p);
// - the draw: the kept tokens' weights summed in float64 by blocks, then one by one in the block that holds the
//   target: the first token whose running sum passes u times the total.
// Every token tied with the k-th, and with the nucleus's last token, is kept, as in the torch path.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "core/simd.h"
#include "ops/fused.h"  // Act, argmax_row

namespace tmk {

// How one row draws. temperature <= 0: the row takes its argmax. top_k <= 0 or >= the vocabulary, top_p >= 1 and
// min_p <= 0 are off.
struct DrawRule {
  float temperature, top_p, min_p;
  int64_t top_k;
  double u;  // in [0, 1)
};

// One thread's buffers, grown to the largest row seen.
struct DrawScratch {
  std::vector<float> x, w, heap;      // [V]: the scaled logits, their weights; the top-k heap (or a copy of x)
  std::vector<int32_t> bin;           // [V]: each value's top-p bin
  std::vector<double> mass;           // per top-p bin, then per draw block
  std::vector<std::pair<float, double>> ranked;  // (value, weight) where the nucleus ends, most likely first
  std::vector<int64_t> kept;          // a top-k's tokens, in vocabulary order (draw_kept)
  std::vector<double> kept_w;         // ... and their weights
};

constexpr int64_t kHeapMax = 1024;     // the largest k kept in a heap
constexpr int kBins = 1024;            // top-p bins
constexpr float kBinsPerUnit = 32.f;   // bins per unit of (max - x)
constexpr int64_t kBlock = 256;        // values per block of the draw's sums
constexpr int64_t kKeptMax = 4096;     // the most tokens a top-k keeps for draw_kept (more: ties with the k-th)

// the k-th largest of x[0..n) (0 < k < n, ties counted; x holds no NaN)
inline float kth_largest(const float* x, int64_t n, int64_t k, std::vector<float>& heap) {
  if (k > kHeapMax) {
    heap.assign(x, x + n);
    std::nth_element(heap.begin(), heap.begin() + (k - 1), heap.end(), std::greater<float>());
    return heap[k - 1];
  }
  heap.assign(x, x + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());  // the least on top
  const auto offer = [&heap](float v) {
    if (!(v > heap.front())) return;
    std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
    heap.back() = v;
    std::push_heap(heap.begin(), heap.end(), std::greater<float>());
  };
  int64_t i = k;
  for (; i + W <= n; i += W)
    if (any_lane(load(x + i) > splat(heap.front())))
      for (int j = 0; j < W; ++j) offer(x[i + j]);
  for (; i < n; ++i) offer(x[i]);
  return heap.front();
}

// Where a nucleus ends among `ranked` (value, weight) pairs, whose larger values weigh `acc` (< target): sorted
// most likely first, a value's tokens join while the mass before them is under `target`; the last value joined.
inline float nucleus_end(std::vector<std::pair<float, double>>& ranked, double acc, double target, float none) {
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& c) { return a.first > c.first; });
  float last = ranked.empty() ? none : ranked[0].first;
  for (size_t j = 0; j < ranked.size() && acc < target;) {
    last = ranked[j].first;
    for (; j < ranked.size() && ranked[j].first == last; ++j) acc += ranked[j].second;
  }
  return last;
}

// The nucleus's last value: the least x whose larger values weigh less than top_p of the kept total, among x >=
// `kept` (top-k's floor); `top` is x's largest. Fills s.w with the kept weights (0 elsewhere) and s.bin.
inline float nucleus_floor(const float* x, int64_t n, float top, float kept, float top_p, DrawScratch& s) {
  float* w = s.w.data();
  int32_t* bin = s.bin.data();
  const vf vtop = splat(top), vkept = splat(kept), ninf = splat(-INFINITY), last = splat((float)(kBins - 1));
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load(x + i);
    vf d = (vtop - v) * splat(kBinsPerUnit);
    d = d < last ? d : last;
    store(w + i, (v >= vkept) & (v > ninf) ? exp_neg(v - vtop) : splat(0.f));
    const vi b = __builtin_convertvector(d, vi);
    std::memcpy(bin + i, &b, sizeof(b));
  }
  for (; i < n; ++i) {
    const float d = (top - x[i]) * kBinsPerUnit;
    w[i] = x[i] >= kept && x[i] > -INFINITY ? std::exp(x[i] - top) : 0.f;
    bin[i] = (int32_t)(d < (float)(kBins - 1) ? d : (float)(kBins - 1));  // as the vectors: a NaN to the last bin
  }
  s.mass.assign(2 * kBins, 0.0);  // two histograms, even and odd values: half the chains through one bin's sum
  double* mass = s.mass.data();
  for (i = 0; i + 2 <= n; i += 2) mass[bin[i]] += w[i], mass[kBins + bin[i + 1]] += w[i + 1];
  if (i < n) mass[bin[i]] += w[i];
  double total = 0;
  for (int b = 0; b < kBins; ++b) total += mass[b] += mass[kBins + b];
  // the bin where the running mass reaches the target; the bins before it are all in the nucleus
  const double target = (double)top_p * total;
  double acc = 0;
  int b = 0;
  while (b < kBins - 1 && acc + mass[b] < target) acc += mass[b++];
  s.ranked.clear();
  for (i = 0; i < n; ++i)
    if (bin[i] == b && w[i] > 0.f) s.ranked.emplace_back(x[i], w[i]);
  return nucleus_end(s.ranked, acc, target, kept);
}

// The index of the first weight whose running sum passes u times the total (weights >= 0, at least one > 0).
inline int64_t inverse_transform_row(const float* w, int64_t n, double u, std::vector<double>& block_mass) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  block_mass.resize(blocks);
  double total = 0;
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t end = std::min(n, (k + 1) * kBlock);
    double a[4] = {0, 0, 0, 0};
    int64_t i = k * kBlock;
    for (; i + 4 <= end; i += 4)
      for (int j = 0; j < 4; ++j) a[j] += w[i + j];
    for (; i < end; ++i) a[0] += w[i];
    total += block_mass[k] = (a[0] + a[1]) + (a[2] + a[3]);
  }
  const double target = u * total;
  double acc = 0;
  int64_t k = 0;
  while (k < blocks - 1 && acc + block_mass[k] <= target) acc += block_mass[k++];
  int64_t last = k * kBlock;  // the block's last token with weight: where its sum, in this order, falls short
  for (int64_t i = k * kBlock, end = std::min(n, (k + 1) * kBlock); i < end; ++i) {
    if (w[i] > 0.f) last = i;
    if ((acc += w[i]) > target) return i;
  }
  return last;
}

// After a top-k whose k-th value is `kth`: the row's token, from its kept tokens alone (x >= kth, in vocabulary
// order), where there are at most kKeptMax: the nucleus, min-p and the draw then look at those few instead of
// the whole row. -1 where there are more.
inline int64_t draw_kept(const float* x, int64_t n, float top, float kth, const DrawRule& r, float* filtered,
                         DrawScratch& s) {
  s.kept.clear();
  const auto take = [&](int64_t i) {
    if (x[i] >= kth && x[i] > -INFINITY) s.kept.push_back(i);
  };
  int64_t i = 0;
  for (; i + W <= n && (int64_t)s.kept.size() <= kKeptMax; i += W)
    if (any_lane(load(x + i) >= splat(kth)))
      for (int j = 0; j < W; ++j) take(i + j);
  for (; i < n && (int64_t)s.kept.size() <= kKeptMax; ++i) take(i);
  if ((int64_t)s.kept.size() > kKeptMax || s.kept.empty()) return -1;
  const size_t m = s.kept.size();
  s.kept_w.resize(m);
  double total = 0;
  for (size_t j = 0; j < m; ++j) total += s.kept_w[j] = std::exp((double)x[s.kept[j]] - (double)top);
  float floor = kth;
  if (r.top_p < 1.f) {  // the nucleus among them
    s.ranked.resize(m);
    for (size_t j = 0; j < m; ++j) s.ranked[j] = {x[s.kept[j]], s.kept_w[j]};
    floor = std::max(floor, nucleus_end(s.ranked, 0.0, (double)r.top_p * total, kth));
  }
  if (r.min_p > 0.f) floor = std::max(floor, top + std::log(r.min_p));
  if (filtered) std::fill(filtered, filtered + n, -INFINITY);
  double sum = 0;
  for (size_t j = 0; j < m; ++j)
    if (x[s.kept[j]] >= floor) {
      sum += s.kept_w[j];
      if (filtered) filtered[s.kept[j]] = x[s.kept[j]];
    }
  const double target = r.u * sum;
  double acc = 0;
  int64_t last = s.kept[0];
  for (size_t j = 0; j < m; ++j)
    if (x[s.kept[j]] >= floor) {
      last = s.kept[j];
      if ((acc += s.kept_w[j]) > target) return last;
    }
  return last;
}

// One row's token. `filtered` (or null): the row's values after the filters (over the temperature; -inf where
// dropped), for tests.
inline int64_t draw_row(const Act& logits, int64_t n, const DrawRule& r, float* filtered, DrawScratch& s) {
  s.x.resize(n), s.w.resize(n), s.bin.resize(n);
  float* x = s.x.data();
  float* w = s.w.data();
  const auto argmax = [&] {  // a greedy row's token, as torch.argmax over the logits as float32
    if (!logits.bf16) return argmax_row((const float*)logits.ptr, n);
    for (int64_t i = 0; i < n; ++i) x[i] = logits.get(i);
    return argmax_row(x, n);
  };
  if (!(r.temperature > 0)) return argmax();
  const vf t = splat(r.temperature), ninf = splat(-INFINITY);
  vf most = ninf;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vf v = logits.getv(i) / t;
    v = v == v ? v : ninf;  // a NaN is never drawn
    store(x + i, v);
    most = v > most ? v : most;
  }
  float top = -INFINITY;
  for (int j = 0; j < W; ++j) top = std::max(top, most[j]);
  for (; i < n; ++i) {
    const float v = logits.get(i) / r.temperature;
    x[i] = v == v ? v : -INFINITY;
    top = std::max(top, x[i]);
  }
  if (top == -INFINITY) return argmax();  // nothing can be drawn (a grammar allows no token)
  if (top == INFINITY) {  // +inf outweighs every finite value: the +inf tokens alone, alike (a penalty's overflow)
    for (i = 0; i < n; ++i) {
      w[i] = x[i] == INFINITY ? 1.f : 0.f;
      if (filtered) filtered[i] = x[i] == INFINITY ? x[i] : -INFINITY;
    }
    return inverse_transform_row(w, n, r.u, s.mass);
  }
  float floor = -INFINITY;  // the least value kept
  if (r.top_k > 0 && r.top_k < n) {
    floor = kth_largest(x, n, r.top_k, s.heap);
    const int64_t token = draw_kept(x, n, top, floor, r, filtered, s);
    if (token >= 0) return token;
  }
  if (r.top_p < 1.f) floor = std::max(floor, nucleus_floor(x, n, top, floor, r.top_p, s));
  if (r.min_p > 0.f) floor = std::max(floor, top + std::log(r.min_p));
  const vf vfloor = splat(floor), vtop = splat(top);
  for (i = 0; i + W <= n; i += W) {
    const vf v = load(x + i);
    const vi keep = (v >= vfloor) & (v > ninf);
    store(w + i, keep ? exp_neg(v - vtop) : splat(0.f));
    if (filtered) store(filtered + i, keep ? v : ninf);
  }
  for (; i < n; ++i) {
    const bool keep = x[i] >= floor && x[i] > -INFINITY;
    w[i] = keep ? std::exp(x[i] - top) : 0.f;
    if (filtered) filtered[i] = keep ? x[i] : -INFINITY;
  }
  return inverse_transform_row(w, n, r.u, s.mass);
}

// logits [B, V] (float32 or bfloat16) -> tokens [B]; rows in parallel, each on one thread (a row of 152k takes
// well under a millisecond: splitting one would cost more in waking threads than it saves).
inline std::vector<int64_t> draw_rows(const char* logits, bool bf16, int64_t B, int64_t V,
                                      const std::vector<DrawRule>& rules, float* filtered) {
  std::vector<int64_t> out(B);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    thread_local DrawScratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      const Act row{(void*)(logits + b * V * (bf16 ? 2 : 4)), bf16};
      out[b] = draw_row(row, V, rules[b], filtered ? filtered + b * V : nullptr, scratch);
    }
  });
  return out;
}

// draw_rows from the sampler's per-row lists (float32 settings, as the torch path holds them) and raw pointers
inline std::vector<int64_t> draw_lists(uintptr_t logits, bool bf16, int64_t B, int64_t V,
                                       const std::vector<double>& temperature,
                                       const std::vector<int64_t>& top_k, const std::vector<double>& top_p,
                                       const std::vector<double>& min_p, const std::vector<double>& u,
                                       uintptr_t filtered) {
  const size_t rows = (size_t)B;
  if (B < 1 || V < 1 || temperature.size() != rows || top_k.size() != rows || top_p.size() != rows ||
      min_p.size() != rows || u.size() != rows)
    throw std::invalid_argument("draw_lists: one temperature, top_k, top_p, min_p and u per row (>= 1 row)");
  std::vector<DrawRule> rules(rows);
  for (size_t b = 0; b < rows; ++b)
    rules[b] = {(float)temperature[b], (float)top_p[b], (float)min_p[b], top_k[b], u[b]};
  return draw_rows((const char*)logits, bf16, B, V, rules, (float*)filtered);
}

}  // namespace tmk
