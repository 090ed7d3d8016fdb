// A mixture-of-experts layer's experts over the rows routed to them, in one call (models/moe.py: SparseMoE).
//
// The rows arrive grouped by expert: counts[e] rows for expert e, in expert order. Each projection is what
// linear() in kernels.cpp computes, expert by expert, on the same rows in the same dtype, so the numbers are the
// per-expert module path's: gate|up, SiLU*mul (ops/fused.h), down. What changes is the threads: a projection's
// work is one list of (expert, output panels) chunks across every chosen expert, so the small matrices of a decode
// step (an expert's down projection is often under the ~256 KB that linear() gives a second thread) keep both
// cores busy, and Python's ~10 calls per expert become one per layer.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "linear/linear.h"
#include "ops/fused.h"
#include "ops/peak.h"
#include "ops/route.h"

namespace tmk {

// One projection of every expert: rows [start[e], start[e + 1]) of x (Kx wide, the model dtype) times expert e's
// packed weight w[e] (N outputs, K inputs), plus its float32 bias bias[e] [N] where `bias` is given -> the same rows of
// out (N wide, the model dtype).
// `xf` [rows, K] float32 is the rows as the kernels read them (prep_row), where they read no bf16 pairs.
inline void experts_linear(const char* x, bool bf16, int64_t Kx, const std::vector<int64_t>& start, Format F,
                           const int64_t* w, int64_t N, int64_t K, char* out, float* xf,
                           const int64_t* bias = nullptr) {
  const int64_t E = (int64_t)start.size() - 1, rows = start[E], e_bytes = bf16 ? 2 : 4;
  const RowPrep how = row_prep(F);
  const bool pairs = pairs_apply(F, bf16, Kx, K);
  if (!pairs)
    at::parallel_for(0, rows, std::max<int64_t>(1, (64 << 10) / K), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) prep_row(x + i * Kx * e_bytes, bf16, Kx, K, how, xf + i * K);
    });
  struct Chunk {
    int64_t expert, p_begin, p_end;
  };
  std::vector<Chunk> chunks;  // ~64 KB of weight reads each (more rows, fewer panels), across every expert
  const int64_t n_panels = (N + P - 1) / P;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t step = panels_per_chunk(F, K, n, 64 << 10);
    for (int64_t p = 0; p < n_panels; p += step) chunks.push_back({e, p, std::min(p + step, n_panels)});
  }
  at::parallel_for(0, (int64_t)chunks.size(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& k = chunks[c];
      const int64_t s = start[k.expert], n = start[k.expert + 1] - s;
      float* o32 = bf16 ? nullptr : (float*)out + s * N;
      uint16_t* o16 = bf16 ? (uint16_t*)out + s * N : nullptr;
      const uint16_t* xh = bf16 ? (const uint16_t*)x + s * Kx : nullptr;
      const float* b = bias ? (const float*)bias[k.expert] : nullptr;
      linear_range(F, pairs ? nullptr : xf + s * K, n, K, (const uint8_t*)w[k.expert], N, K, b, o32, o16,
                   k.p_begin, k.p_end, xh, Kx);
    }
  });
}

// A batch's (token, choice) pairs grouped by expert, in token order within each: ids [T, k] (pair r = t k + j) ->
// the pairs of expert e at [start[e], start[e + 1]), order[i] the pair at i, pos[r] where pair r lies; `active` the
// experts with a pair, in order. The module path and the decode stack group alike, so each expert sees its rows in
// the same order and count on both.
struct Grouping {
  std::vector<int64_t> start, order, pos, active;
  void build(const int64_t* ids, int64_t R, int64_t E) {
    for (int64_t r = 0; r < R; ++r)
      if (ids[r] < 0 || ids[r] >= E) throw std::invalid_argument("moe: an expert id out of range");
    start.assign(E + 1, 0), order.resize(R), pos.resize(R), active.clear();
    for (int64_t r = 0; r < R; ++r) ++start[ids[r] + 1];
    for (int64_t e = 0; e < E; ++e) {
      if (start[e + 1]) active.push_back(e);
      start[e + 1] += start[e];
    }
    next_.assign(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < R; ++r) order[pos[r] = next_[ids[r]]++] = r;
  }

 private:
  std::vector<int64_t> next_;
};

// token t's MoE output: the sum over its k pairs, in expert order, of weight * that pair's row of ys (grouped as
// `g`), each product and each sum rounded to the model dtype as transformers' index_add_ over the experts in turn
// gives it -> out [D]. W lanes of D at a time, then the rest one by one: the same operations on every element.
inline void combine_row(Act out, const char* ys, const Grouping& g, const int64_t* ids, const float* weight, int64_t t,
                        int64_t k, int64_t D) {
  const int64_t e_bytes = out.bf16 ? 2 : 4;
  int64_t mine[64];
  for (int64_t j = 0; j < k; ++j) mine[j] = t * k + j;
  std::sort(mine, mine + k, [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  Act y[64];
  for (int64_t j = 0; j < k; ++j) y[j] = Act{(void*)(ys + g.pos[mine[j]] * D * e_bytes), out.bf16};
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    vf sum = splat(0.f);
    for (int64_t j = 0; j < k; ++j) {
      vf product = out.roundv(y[j].getv(d) * splat(weight[mine[j]]));
      opaque(product);  // rounded, as torch's multiply stores it: never fused into the add (-ffp-contract=fast)
      sum = out.roundv(sum + product);
    }
    out.setv(d, sum);
  }
  for (; d < D; ++d) {
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      float product = out.round(y[j].get(d) * weight[mine[j]]);
      opaque(product);
      sum = out.round(sum + product);
    }
    out.set(d, sum);
  }
}

// The buffers of moe_routed, kept between its calls on the calling thread (each engine thread has its own): a
// prefill's layers each needed ~10-50 MB of them, which glibc maps afresh above 128 KB (memory.py), so every call
// zeroed and faulted in new pages (a fifth of a Qwen3-MoE prefill's time). `moe_release_scratch` lets them go
// when the engine goes idle (models/moe.py: MoECausalLM.release_scratch).
class MoEScratch {
 public:
  char* get(size_t bytes) {
    if (bytes > cap_) {  // (not zeroed: every byte is written before it is read)
      buf_.reset();
      buf_.reset(new char[bytes]);
      cap_ = bytes;
    }
    return buf_.get();
  }
  void release() { buf_.reset(), cap_ = 0; }

 private:
  std::unique_ptr<char[]> buf_;
  size_t cap_ = 0;
};
inline thread_local MoEScratch moe_scratch;

inline void moe_release_scratch() { moe_scratch.release(); }

// A MoE layer after its router: ids [T, k] int64 each token's experts (distinct, k <= 64), w [T, k] float32 their
// weights (rounded to the model dtype first where the family rounds them; ops/route.h) -> out [T, D], each token's
// combine_row. x and out in the model dtype (bfloat16 where `bf16`, else float32); gate_up / down [E] int64 the
// experts' packed weights (one format each: gate|up 2I x gu_K, down D x dn_K); gu_bias / dn_bias [E] int64 pointers to
// their float32 biases, or 0. The activation: SiLU(gate) * up, or with `clamped` gpt-oss's clamped SwiGLU
// (ops/fused.h: clamped_swiglu_rows, at alpha and limit).
inline void moe_routed(uintptr_t x, bool bf16, int64_t T, int64_t D, uintptr_t ids, uintptr_t w, int64_t k, int64_t E,
                       uintptr_t gate_up, int64_t gu_format, int64_t gu_K, uintptr_t down, int64_t dn_format,
                       int64_t I, int64_t dn_K, uintptr_t out, uintptr_t gu_bias = 0, uintptr_t dn_bias = 0,
                       bool clamped = false, double alpha = 0, double limit = 0) {
  if (k < 1 || k > 64) throw std::invalid_argument("moe: 1 to 64 experts per token");
  const int64_t R = T * k, e_bytes = bf16 ? 2 : 4;
  const int64_t* id = (const int64_t*)ids;
  Grouping g;
  g.build(id, R, E);
  // [R, D] the pairs' token rows, later their outputs (ys); [R, 2I] gate|up; [R, I] the activation; [R, max K]
  // float32 the rows as the kernels read them (each projection's in turn); each part 64-byte aligned
  const auto part = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t b_rows = part(R * D * e_bytes), b_h = part(R * 2 * I * e_bytes), b_act = part(R * I * e_bytes);
  char* base = moe_scratch.get(b_rows + b_h + b_act + part(R * std::max(gu_K, dn_K) * 4) + 64);
  char* rows = base + (64 - (uintptr_t)base % 64) % 64;
  char *h = rows + b_rows, *act = h + b_h, *ys = rows;
  float* xf = (float*)(act + b_act);
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {  // each pair's token row, grouped by expert
    for (int64_t j = begin; j < end; ++j)
      std::memcpy(rows + j * D * e_bytes, (const char*)x + g.order[j] / k * D * e_bytes, D * e_bytes);
  });
  experts_linear(rows, bf16, D, g.start, static_cast<Format>(gu_format), (const int64_t*)gate_up, 2 * I, gu_K, h, xf,
                 (const int64_t*)gu_bias);
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    const Act in{h + begin * 2 * I * e_bytes, bf16}, o{act + begin * I * e_bytes, bf16};
    if (clamped) clamped_swiglu_rows(in, o, end - begin, I, (float)alpha, (float)limit);
    else silu_mul_rows(in, o, end - begin, I);
  });
  experts_linear(act, bf16, I, g.start, static_cast<Format>(dn_format), (const int64_t*)down, D, dn_K, ys, xf,
                 (const int64_t*)dn_bias);  // (the token rows are read: ys takes their place)
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      combine_row(Act{(char*)out + t * D * e_bytes, bf16}, ys, g, id, (const float*)w, t, k, D);
  });
}

// The router over T tokens (ops/route.h): x [T, D] and router [E, D] in the model dtype, with its bias [E] (the
// model dtype; 0: none) -> ids [T, k] int64, weights [T, k] float32
inline void moe_route(uintptr_t x, bool bf16, int64_t T, int64_t D, uintptr_t router, int64_t E, int64_t k,
                      bool renorm, bool keep_f32, uintptr_t ids, uintptr_t weights, uintptr_t bias,
                      bool softmax_after_top_k) {
  const int64_t e_bytes = bf16 ? 2 : 4;
  const Routing r{E, k, renorm, keep_f32, (const char*)bias, softmax_after_top_k};
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      route_row(Act{(char*)x + t * D * e_bytes, bf16}, (const char*)router, D, r, (int64_t*)ids + t * k,
                (float*)weights + t * k);
  });
}

}  // namespace tmk
