// A sparse layer's MLP in the decode stack (stack/stack.h): the router, then the chosen experts over their rows,
// then each row's weighted sum, with the numbers of the module path (linear/experts.h: moe_routed after moe_route).
//
// The stack's program has a fixed list of stages; a sparse layer takes the dense MLP's four:
//   post_norm_route  (a chunk per row)  the norm, the row's router (ops/route.h) and its row for the experts' linears;
//                                       the last row to finish groups the step's (row, choice) pairs by expert;
//   experts_gate_up  (chunks of (expert, output panels))  each chosen expert's gate|up over its rows;
//   experts_silu     (a chunk per pair)  SiLU*mul (gpt-oss: the clamped SwiGLU), and the row for the down projection;
//   experts_down     (as gate_up)        each chosen expert's down projection.
// Each row's weighted sum is added by the next per-row stage (the next layer's input norm, or the final norm).
// The experts a step chooses are only known inside it, so the expert stages get chunks for the most experts the
// step's rows can choose, min(E, rows x k), each expert's panels in equal groups; a chunk past the chosen experts
// is empty. So one busy expert's panels still spread over every thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "linear/experts.h"
#include "linear/linear.h"
#include "ops/fused.h"
#include "ops/route.h"

namespace tmk {

struct MoELayer {
  const char* router;  // [E, D], the model dtype
  Routing routing;
  const int64_t *gate_up, *down;  // [E] each: the experts' packed weights, gate|up [2I, gu_K] and down [D, dn_K]
  Format gu, dn;
  int64_t gu_K, dn_K, I;
  const int64_t *gu_bias = nullptr, *dn_bias = nullptr;  // [E] pointers to float32 biases [2I] / [D] (gpt-oss), or null
  bool clamped = false;                                  // gpt-oss's clamped SwiGLU (at alpha, limit), not SiLU*mul
  float alpha = 0.f, limit = 0.f;
};

class MoEStages {
 public:
  MoEStages(bool bf16, int64_t D) : bf16_(bf16), e_(bf16 ? 2 : 4), D_(D) {}

  int64_t add(const MoELayer& m) {
    if (m.routing.k < 1 || m.routing.k > 64 || m.routing.k > m.routing.experts)
      throw std::invalid_argument("a MoE layer chooses 1 to 64 of its experts per token");
    layers_.push_back(m);
    max_k_ = std::max(max_k_, m.routing.k), max_i_ = std::max(max_i_, m.I), max_dn_k_ = std::max(max_dn_k_, m.dn_K);
    return (int64_t)layers_.size() - 1;
  }
  const MoELayer& layer(int64_t m) const { return layers_[m]; }

  // a step of B rows: the scratch for them, and each layer's expert chunks
  void begin(int64_t B) {
    B_ = B;
    routed_.store(0, std::memory_order_relaxed);  // (a step that failed inside the routing stage left it counting)
    const int64_t R = B * max_k_;
    if (R > pairs_) {
      ids_.resize(R), weights_.resize(R), xq_.resize(R * max_dn_k_);
      h_.resize(R * 2 * max_i_ * e_), act_.resize(R * max_i_ * e_), ys_.resize(R * D_ * e_);
      pairs_ = R;
    }
    gu_per_.resize(layers_.size()), dn_per_.resize(layers_.size());
    for (size_t m = 0; m < layers_.size(); ++m) {
      const MoELayer& s = layers_[m];
      gu_per_[m] = per_chunk(s.gu, s.gu_K, 2 * s.I, s.routing);
      dn_per_[m] = per_chunk(s.dn, s.dn_K, D_, s.routing);
    }
  }

  int64_t gate_up_chunks(int64_t m) const { return chunks(m, 2 * layers_[m].I, gu_per_[m]); }
  int64_t silu_chunks(int64_t m) const { return B_ * layers_[m].routing.k; }
  int64_t down_chunks(int64_t m) const { return chunks(m, D_, dn_per_[m]); }

  // row b's router over its normed row (the model dtype, D wide); the last row of the step to finish groups the
  // pairs (the stage ends after it)
  void route(int64_t m, int64_t b, const char* normed) {
    const MoELayer& s = layers_[m];
    const int64_t k = s.routing.k;
    route_row(Act{(void*)normed, bf16_}, s.router, D_, s.routing, ids_.data() + b * k, weights_.data() + b * k);
    if (routed_.fetch_add(1, std::memory_order_acq_rel) + 1 < B_) return;
    routed_.store(0, std::memory_order_relaxed);
    groups_.build(ids_.data(), B_ * k, s.routing.experts);
  }

  // chunk c of the gate|up projections: the experts' rows are rows of `xq` (prepared for the format, ldxq floats
  // apart) or, where the bf16 pair tiles read them, of `normed` (the model dtype, D wide), gathered here
  void gate_up(int64_t m, int64_t c, const char* normed, const float* xq, int64_t ldxq) {
    const MoELayer& s = layers_[m];
    const bool pairs = pairs_apply(s.gu, bf16_, D_, s.gu_K);
    int64_t e, row0, n, p0, p1;
    if (!chunk(m, c, 2 * s.I, gu_per_[m], e, row0, n, p0, p1)) return;
    thread_local std::vector<float> rows32;
    thread_local std::vector<char> rows16;
    const int64_t k = s.routing.k;
    if (pairs) rows16.resize(n * D_ * 2);
    else rows32.resize(n * s.gu_K);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = groups_.order[row0 + i] / k;
      if (pairs) std::memcpy(rows16.data() + i * D_ * 2, normed + b * D_ * 2, D_ * 2);
      else std::memcpy(rows32.data() + i * s.gu_K, xq + b * ldxq, s.gu_K * 4);
    }
    project(s.gu, (const uint8_t*)s.gate_up[e], 2 * s.I, s.gu_K, pairs ? nullptr : rows32.data(),
            pairs ? (const uint16_t*)rows16.data() : nullptr, D_, n, h_.data() + row0 * 2 * s.I * e_, p0, p1,
            s.gu_bias ? (const float*)s.gu_bias[e] : nullptr);
  }

  // pair r (in expert order): SiLU*mul (or the clamped SwiGLU), and its row readied for the down projection
  void silu(int64_t m, int64_t r) {
    const MoELayer& s = layers_[m];
    char* out = act_.data() + r * s.I * e_;
    const Act h{h_.data() + r * 2 * s.I * e_, bf16_};
    if (s.clamped) clamped_swiglu_rows(h, Act{out, bf16_}, 1, s.I, s.alpha, s.limit);
    else silu_mul_rows(h, Act{out, bf16_}, 1, s.I);
    if (!pairs_apply(s.dn, bf16_, s.I, s.dn_K))
      prep_row(out, bf16_, s.I, s.dn_K, row_prep(s.dn), xq_.data() + r * max_dn_k_);
  }

  void down(int64_t m, int64_t c) {
    const MoELayer& s = layers_[m];
    const bool pairs = pairs_apply(s.dn, bf16_, s.I, s.dn_K);
    int64_t e, row0, n, p0, p1;
    if (!chunk(m, c, D_, dn_per_[m], e, row0, n, p0, p1)) return;
    project(s.dn, (const uint8_t*)s.down[e], D_, s.dn_K, pairs ? nullptr : xq_.data() + row0 * max_dn_k_,
            pairs ? (const uint16_t*)(act_.data() + row0 * s.I * 2) : nullptr, s.I, n, ys_.data() + row0 * D_ * e_,
            p0, p1, s.dn_bias ? (const float*)s.dn_bias[e] : nullptr, max_dn_k_);
  }

  // row b's weighted sum over its experts -> out [D] (the model dtype)
  void combine(int64_t m, int64_t b, char* out) const {
    combine_row(Act{out, bf16_}, ys_.data(), groups_, ids_.data(), weights_.data(), b, layers_[m].routing.k, D_);
  }

 private:
  // output panels per chunk of a projection with N outputs: ~256 KB of weight reads at the step's rows per expert
  int64_t per_chunk(Format F, int64_t K, int64_t N, const Routing& r) const {
    const int64_t experts = std::min(r.experts, B_ * r.k), rows = (B_ * r.k + experts - 1) / experts;
    const int64_t n_panels = (N + P - 1) / P;
    const int64_t per = std::min(n_panels, panels_per_chunk(F, K, rows, 256 << 10));
    return std::min(n_panels, per + (per & 1));  // even: AMX tiles take panels two at a time
  }
  int64_t chunks(int64_t m, int64_t N, int64_t per) const {
    const Routing& r = layers_[m].routing;
    const int64_t n_panels = (N + P - 1) / P;
    return std::min(r.experts, B_ * r.k) * ((n_panels + per - 1) / per);
  }
  // chunk c -> the chosen expert e, its rows [row0, row0 + n) and panels [p0, p1); false past the chosen experts
  bool chunk(int64_t m, int64_t c, int64_t N, int64_t per, int64_t& e, int64_t& row0, int64_t& n, int64_t& p0,
             int64_t& p1) const {
    const int64_t n_panels = (N + P - 1) / P, groups = (n_panels + per - 1) / per, a = c / groups;
    if (a >= (int64_t)groups_.active.size()) return false;
    e = groups_.active[a], row0 = groups_.start[e], n = groups_.start[e + 1] - row0;
    p0 = c % groups * per, p1 = std::min(n_panels, p0 + per);
    (void)m;
    return true;
  }
  // rows x32 (prepared, ldx floats apart; default K) or x16 (the model's bf16, Kx wide) times w -> out rows
  void project(Format F, const uint8_t* w, int64_t N, int64_t K, const float* x32, const uint16_t* x16, int64_t Kx,
               int64_t n, char* out, int64_t p0, int64_t p1, const float* bias, int64_t ldx = 0) const {
    linear_range(F, x32, n, ldx ? ldx : K, w, N, K, bias, bf16_ ? nullptr : (float*)out,
                 bf16_ ? (uint16_t*)out : nullptr, p0, p1, x16, Kx);
  }

  const bool bf16_;
  const int64_t e_, D_;
  std::vector<MoELayer> layers_;
  int64_t max_k_ = 0, max_i_ = 0, max_dn_k_ = 0;
  int64_t B_ = 0, pairs_ = 0;
  std::vector<int64_t> gu_per_, dn_per_;  // this step's output panels per chunk, per layer
  // this step's pairs (a layer's at a time): ids_, weights_ [B, k] as the router gave them, grouped by groups_;
  // h_ [R, 2I], act_ [R, I], ys_ [R, D] in the model dtype and xq_ [R, max_dn_k_] (the down rows) in pair order
  std::vector<int64_t> ids_;
  std::vector<float> weights_, xq_;
  std::vector<char> h_, act_, ys_;
  Grouping groups_;
  std::atomic<int64_t> routed_{0};  // rows routed this layer (back at 0 after each)
};

}  // namespace tmk
