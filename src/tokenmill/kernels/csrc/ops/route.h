// A mixture-of-experts router over one token (models/moe.py: SparseMoE.route), in one place for both of its
// callers: the module path (one call per layer, every token of the batch) and the decode stack (one chunk per row).
// So the two pick the same experts with the same weights, to the bit.
//
// The numbers are transformers' (Qwen3-MoE, Mixtral): the logits W x, float32 sums stored in the model dtype as
// torch's linear stores them; the softmax over all E in float32; its top k (in torch.topk's order, ties
// included: top_k); renormalised over those k where the config says so; rounded to the model dtype unless the
// family scales in float32. Only the sums' order differs from torch's (lanes, then the lanes added in turn).
// gpt-oss's router (GptOssTopKRouter) adds a bias to the logits (W x + b, one rounding, as torch's linear with a
// bias) and takes the top k of the logits, then the softmax over those k alone (`softmax_after_top_k`).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "ops/fused.h"

namespace tmk {

struct Routing {
  int64_t experts, k;
  bool renorm;    // the top k weights divided by their sum
  bool keep_f32;  // the weights stay float32 (else rounded to the model dtype, as their cast there rounds them)
  const char* bias = nullptr;        // [E] in the model dtype, added to the logits (gpt-oss), or null
  bool softmax_after_top_k = false;  // the top k logits, then their softmax (gpt-oss), not the softmax's top k
};

// sum over i < n of x[i] * w[i]: x float32, w the model dtype
inline float dot_row(const float* x, Act w, int64_t n) {
  vf acc = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc += load(x + i) * w.getv(i);
  float sum = 0.f;
  for (int j = 0; j < W; ++j) sum += acc[j];
  for (; i < n; ++i) sum += x[i] * w.get(i);
  return sum;
}

// The k largest of p[0..n) (float32; a NaN counts as the largest) -> their indices, the largest first, with equal
// values in the order torch.topk leaves them on the CPU: it selects with the standard library's nth_element and
// then sorts the first k - 1 (partial_sort where k * 64 <= n) over (value, index) pairs compared by value alone, so
// ties land where those algorithms put them. Ties are common where the logits are bfloat16; another tie rule picks
// another expert than transformers does.
inline void top_k(const float* p, int64_t n, int64_t k, int64_t* out) {
  thread_local std::vector<std::pair<float, int64_t>> queue;
  queue.resize(n);
  for (int64_t i = 0; i < n; ++i) queue[i] = {p[i], i};
  const auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  if (k * 64 <= n) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
  for (int64_t j = 0; j < k; ++j) out[j] = queue[j].second;
}

// The softmax over the k logits p[order[0..k)] (the largest first) -> weights [k], rounded as Routing says
inline void softmax_chosen(const float* p, const int64_t* order, const Routing& r, Act x, float* weights) {
  float top = -INFINITY, sum = 0.f;
  for (int64_t j = 0; j < r.k; ++j) top = std::max(top, p[order[j]]);
  for (int64_t j = 0; j < r.k; ++j) sum += (weights[j] = std::exp(p[order[j]] - top));
  for (int64_t j = 0; j < r.k; ++j) weights[j] = r.keep_f32 ? weights[j] / sum : x.round(weights[j] / sum);
}

// x [D] (the model dtype), router [E, D] (the model dtype) -> ids [k] int64, weights [k] float32
inline void route_row(Act x, const char* router, int64_t D, const Routing& r, int64_t* ids, float* weights) {
  const int64_t e_bytes = x.bf16 ? 2 : 4;
  thread_local std::vector<float> xf, p;
  thread_local std::vector<int64_t> order;
  xf.resize(D), p.resize(r.experts), order.resize(r.k);
  for (int64_t d = 0; d < D; ++d) xf[d] = x.get(d);
  const Act bias{(void*)r.bias, x.bf16};
  float top = -INFINITY;
  for (int64_t e = 0; e < r.experts; ++e) {
    const float dot = dot_row(xf.data(), Act{(void*)(router + e * D * e_bytes), x.bf16}, D);
    p[e] = x.round(r.bias ? dot + bias.get(e) : dot);
    top = std::max(top, p[e]);
  }
  if (r.softmax_after_top_k) {
    top_k(p.data(), r.experts, r.k, order.data());
    std::copy(order.begin(), order.end(), ids);
    return softmax_chosen(p.data(), order.data(), r, x, weights);
  }
  float sum = 0.f;
  for (int64_t e = 0; e < r.experts; ++e) sum += (p[e] = std::exp(p[e] - top));
  for (int64_t e = 0; e < r.experts; ++e) p[e] /= sum;
  top_k(p.data(), r.experts, r.k, order.data());
  float chosen = 0.f;
  for (int64_t j = 0; j < r.k; ++j) chosen += p[order[j]];
  for (int64_t j = 0; j < r.k; ++j) {
    ids[j] = order[j];
    const float w = r.renorm ? p[order[j]] / chosen : p[order[j]];
    weights[j] = r.keep_f32 ? w : x.round(w);
  }
}

}  // namespace tmk
