// The sampler's logprobs on the CPU: per asked-for row, the log-softmax of its logits at its chosen token and at
// its `top` most likely tokens, most likely first (ties: the lower token id first). sampling/sampler.py's
// `topk_logprobs` over torch's log_softmax is the reference and the path elsewhere; there every row's [V]
// logprobs were written and then partly sorted, milliseconds a step at 16 rows.
// Here a row takes two passes: its max, then the sum of e^(x - max) (float lanes, float64 across blocks) beside a
// heap of its most likely tokens, where a vector of values is looked at one by one only if one passes the heap's
// least. A logprob is (x - max) - log(sum), as torch rounds it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include "core/simd.h"
#include "ops/fused.h"  // Act

namespace tmk {

// a row's chosen token's logprob, and its most likely tokens' (id, logprob), most likely first
using RowLogprobs = std::pair<float, std::vector<std::pair<int64_t, float>>>;

inline RowLogprobs logprobs_row(const Act& x, int64_t n, int64_t token, int64_t top,
                                std::vector<std::pair<float, int64_t>>& heap) {
  vf most = splat(-INFINITY);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = x.getv(i);
    most = v > most ? v : most;
  }
  float m = -INFINITY;
  for (int j = 0; j < W; ++j) m = std::max(m, most[j]);
  for (; i < n; ++i) m = std::max(m, x.get(i));
  // the heap's top is its worst entry: the least value, of equal values the higher id (it came later)
  const auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  heap.clear();
  const auto offer = [&](int64_t at, float v) {
    if ((int64_t)heap.size() < top) {
      heap.emplace_back(v, at);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (top > 0 && v > heap.front().first) {  // an equal value later in the row never displaces one
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = {v, at};
      std::push_heap(heap.begin(), heap.end(), better);
    }
  };
  const vf vm = splat(m);
  double sum = 0;
  i = 0;
  while (i + W <= n) {
    vf acc = splat(0.f);
    for (const int64_t end = std::min(n - W, i + 255 * W); i <= end; i += W) {  // float lanes, 256 vectors at most
      const vf v = x.getv(i);
      acc += exp_neg(v - vm);
      if (top > 0 && ((int64_t)heap.size() < top || any_lane(v > splat(heap.front().first))))
        for (int j = 0; j < W; ++j) offer(i + j, x.get(i + j));
    }
    for (int j = 0; j < W; ++j) sum += acc[j];
  }
  for (; i < n; ++i) {
    const float v = x.get(i);
    sum += std::exp(v - m);
    offer(i, v);
  }
  const float log_sum = (float)std::log(sum);
  std::sort(heap.begin(), heap.end(), better);
  RowLogprobs out{(x.get(token) - m) - log_sum, {}};
  out.second.reserve(heap.size());
  for (const auto& [v, at] : heap) out.second.emplace_back(at, (v - m) - log_sum);
  return out;
}

// Rows `rows` of logits [B, V] (float32 or bfloat16): each one's logprobs at tokens[r] and its num_top[r] most
// likely tokens; rows in parallel.
inline std::vector<RowLogprobs> logprobs_lists(uintptr_t logits, bool bf16, int64_t B, int64_t V,
                                               const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                                               const std::vector<int64_t>& num_top) {
  const size_t R = rows.size();
  if (tokens.size() != R || num_top.size() != R) throw std::invalid_argument("logprobs: one token and count per row");
  for (size_t r = 0; r < R; ++r)
    if (rows[r] < 0 || rows[r] >= B || tokens[r] < 0 || tokens[r] >= V || num_top[r] < 0)
      throw std::invalid_argument("logprobs: a row, token or count outside the logits");
  std::vector<RowLogprobs> out(R);
  at::parallel_for(0, (int64_t)R, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<std::pair<float, int64_t>> heap;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t top = std::min(num_top[r], V);
      const Act row{(void*)((const char*)logits + rows[r] * V * (bf16 ? 2 : 4)), bf16};
      out[r] = logprobs_row(row, V, tokens[r], top, heap);
    }
  });
  return out;
}

}  // namespace tmk
