// The decode stack's state and what each of its stages does (stack/stack.h makes a step's program of them): the
// layers' specs, the scratch activations and the step's inputs, and the work of one row, one chunk of output
// panels or one attention task. DecodeStack derives from it; the state has this one owner.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention/decode.h"
#include "linear/format.h"
#include "linear/linear.h"
#include "linear/segments.h"
#include "linear/unpack.h"
#include "ops/fused.h"
#include "stack/head.h"
#include "stack/lora.h"
#include "stack/moe.h"

namespace tmk {

struct LayerSpec {
  uintptr_t in_norm, post_norm, q_norm, k_norm, cache;  // q_norm / k_norm: 0 without (Qwen3 has them)
  LinearSpec qkv, o, gate_up, down;                     // (gate_up, down: a sparse layer's are unused)
  int64_t moe = -1;                                     // a sparse layer's index in moe_, else -1
  uintptr_t kv_scales = 0;  // a quantized cache's bf16 scales [2, slots, Hkv] (attention/kv_quant.h), else 0
  bool kv_fp8 = false;      // that cache's rows are float8 e4m3, not int8
  int64_t window = 0;       // > 0: the layer attends to each row's last `window` positions only (sliding window)
  const float* sinks = nullptr;  // [H] float32: each head's sink logit in its softmax (gpt-oss), or null
};

class StackStages {
 protected:
  StackStages(bool bf16, int64_t D, int64_t H, int64_t Hkv, int64_t Dh, int64_t I, double eps, int64_t slots,
              uintptr_t final_norm, int threads)
      : bf16_(bf16), e_(bf16 ? 2 : 4), D_(D), H_(H), Hkv_(Hkv), Dh_(Dh), I_(I), eps_((float)eps), slots_(slots),
        final_norm_(final_norm), threads_(std::max(1, threads)), moe_(bf16, D) {}

  Act act(char* base, int64_t row, int64_t width) const { return Act{base + row * width * e_, bf16_}; }

  // row `id` of the embedding at `embed` -> dst (D_ values in the model dtype)
  void embed_row(uintptr_t embed, int64_t id, char* dst) const {
    if (emb_format_ < 0) return (void)std::memcpy(dst, (const char*)embed + id * D_ * e_, D_ * e_);
    thread_local std::vector<float> row;
    row.resize(emb_k_);
    unpack_rows((Format)emb_format_, (const uint8_t*)embed, emb_k_, &id, 1, row.data());
    for (int64_t d = 0; d < D_; ++d) {
      if (bf16_) ((uint16_t*)dst)[d] = float_to_bf16(row[d]);
      else ((float*)dst)[d] = row[d];
    }
  }
  Act param(uintptr_t p) const { return Act{(void*)p, bf16_}; }

  // Output panels per chunk of linear `w`: ~1 MB of weights (long runs of sequential reads: the first few KB of each
  // chunk wait on memory before the prefetches run ahead), but at least four chunks per
  // thread, so a thread that starts late or loses its core leaves little for the others to wait on.
  int64_t per_chunk(const LinearSpec& w) const {
    const int64_t n_panels = (w[2] + P - 1) / P;
    const int64_t balanced = std::max<int64_t>(1, n_panels / (4 * threads_));
    return amx_even((Format)w[1], B_, std::min(panels_per_chunk((Format)w[1], w[3], B_, 1 << 20), balanced));
  }

  int64_t chunks(const LinearSpec& w) const {
    const int64_t n_panels = (w[2] + P - 1) / P, per = per_chunk(w);
    return (n_panels + per - 1) / per;
  }

  // the output panels [begin, end) of chunk c of linear `w`
  std::pair<int64_t, int64_t> chunk_panels(const LinearSpec& w, int64_t c) const {
    const int64_t n_panels = (w[2] + P - 1) / P, per = per_chunk(w);
    return {c * per, std::min(n_panels, c * per + per)};
  }

  // row b of `src` (width Kx, the model dtype) -> xq(), ready for linear `w`: pair-major where the pair tiles take
  // the step's rows (linear/pair_rows.h; a lone row is that already, and they read src), else prep_row's row b
  // (unless the AMX tiles read src itself); only its columns [k0, k1) where k1 >= 0 (multiples of the rows' group,
  // as prep_row)
  void prep(const char* src, int64_t Kx, const LinearSpec& w, int64_t b, int64_t k0 = 0, int64_t k1 = -1) {
    const Format F = (Format)w[1];
    if (takes_pair_major(F, bf16_, Kx, w[3], B_)) {
      if (B_ > 1) write_pairs((const uint16_t*)src, B_, w[3], b, (int32_t*)xq(), k0 / 2, k1 < 0 ? -1 : k1 / 2);
    } else if (!pairs_apply(F, bf16_, Kx, w[3])) {
      prep_row(src, bf16_, Kx, w[3], row_prep(w), xq() + b * max_k_, k0, k1);
    }
  }

  // output panels of chunk c of linear `w`, from the rows prep readied, or for a bf16 model from its input rows
  // `src` (`width` wide, the model dtype) where the AMX tiles or a lone row's pair tile read them; then, for layer
  // l's projection p (l >= 0: stack/lora.h), the adapter rows' updates of those columns
  void panels(const LinearSpec& w, int64_t c, char* out, const char* src, int64_t width, int64_t l = -1, int p = 0) {
    const auto [begin, end] = chunk_panels(w, c);
    const bool pair_major = takes_pair_major((Format)w[1], bf16_, width, w[3], B_);
    const uint16_t* xh = !bf16_ ? nullptr : pair_major && B_ > 1 ? (const uint16_t*)xq() : (const uint16_t*)src;
    linear_spec_range(w, xq(), B_, max_k_, bf16_ ? nullptr : (float*)out, bf16_ ? (uint16_t*)out : nullptr, begin,
                      end, xh, width, pair_major);
    if (l >= 0 && lora_.on()) lora_.add_columns(l, p, Act{out, bf16_}, w[2], begin * P, std::min(w[2], end * P));
  }

  // a sparse layer's MLP output for row b (each row's weighted sum of its experts) -> hidden_ row b, where the
  // dense layers' down projection leaves it
  void mlp_out(int64_t l, int64_t b) {
    if (layers_[l].moe >= 0) moe_.combine(layers_[l].moe, b, hidden_ + b * D_ * e_);
  }

  void input_norm(int64_t l, int64_t b) {
    const LayerSpec& s = layers_[l];
    if (l > 0) mlp_out(l - 1, b);
    if (l == 0) rmsnorm_rows(act(residual_, b, D_), Act{nullptr, bf16_}, false, param(s.in_norm), eps_,
                             act(normed_, b, D_), 1, D_);
    else rmsnorm_rows(act(hidden_, b, D_), act(residual_, b, D_), true, param(s.in_norm), eps_, act(normed_, b, D_),
                      1, D_);
    prep(normed_ + b * D_ * e_, D_, s.qkv, b);
    lora_.row_ready(l, StackLoras::QKV, b, Act{normed_, bf16_}, D_);
  }

  // row b's query heads (q/k norms where the model has them, RoPE) -> q_, its keys (RoPE) and values -> the cache
  void rope_and_write(int64_t l, int64_t b) {
    for (int64_t g = 0; g < Hkv_; ++g) {
      rope_queries(l, b, g, q_ + (b * H_ + g * H_ / Hkv_) * Dh_ * e_);
      rope_and_write_kv(l, b, g);
    }
  }

  // row b's G query heads of KV head g, per-head RMSNorm'd (Qwen3) and rotated -> dst [G, Dh] (the model dtype);
  // qkv_ is only read
  void rope_queries(int64_t l, int64_t b, int64_t g, char* dst) {
    const LayerSpec& s = layers_[l];
    const int64_t width = (H_ + 2 * Hkv_) * Dh_, G = H_ / Hkv_;
    const char* q = qkv_ + (b * width + g * G * Dh_) * e_;
    const Act none{nullptr, bf16_};
    if (s.q_norm) rmsnorm_rows(Act{(void*)q, bf16_}, none, false, param(s.q_norm), eps_, Act{dst, bf16_}, G, Dh_);
    else std::memcpy(dst, q, G * Dh_ * e_);
    const Act cos{(void*)(cos_ + b * Dh_ * e_), bf16_}, sin{(void*)(sin_ + b * Dh_ * e_), bf16_};
    rope_rows(Act{dst, bf16_}, cos, sin, 1, G, Dh_, G * Dh_);
  }

  // row b's key of KV head g (its norm, RoPE; in place in qkv_) and value -> the new token's slot in the cache
  // (rows of Hkv * Dh, this head's Dh at g * Dh)
  void rope_and_write_kv(int64_t l, int64_t b, int64_t g) {
    const LayerSpec& s = layers_[l];
    const int64_t width = (H_ + 2 * Hkv_) * Dh_, kv_width = Hkv_ * Dh_;
    char* k = qkv_ + (b * width + (H_ + g) * Dh_) * e_;
    const char* v = qkv_ + (b * width + (H_ + Hkv_ + g) * Dh_) * e_;
    if (s.k_norm) rmsnorm_rows(Act{k, bf16_}, Act{nullptr, bf16_}, false, param(s.k_norm), eps_, Act{k, bf16_}, 1, Dh_);
    const Act cos{(void*)(cos_ + b * Dh_ * e_), bf16_}, sin{(void*)(sin_ + b * Dh_ * e_), bf16_};
    rope_rows(Act{k, bf16_}, cos, sin, 1, 1, Dh_, width);
    const int64_t key = slot_[b] * Hkv_ + g, value = (slots_ + slot_[b]) * Hkv_ + g;  // rows of the cache
    if (s.kv_scales) {
      with_row_types(s, [&](auto* t, auto* c) {
        using T = std::remove_pointer_t<decltype(t)>;
        using C = std::remove_pointer_t<decltype(c)>;
        if constexpr (kv_quantized<C>) {
          uint16_t* scales = (uint16_t*)s.kv_scales;
          quantize_kv_row((const T*)k, Dh_, (C*)s.cache + key * Dh_, scales + key);
          quantize_kv_row((const T*)v, Dh_, (C*)s.cache + value * Dh_, scales + value);
        }
      });
      return;
    }
    char* cache = (char*)s.cache;
    std::memcpy(cache + key * Dh_ * e_, k, Dh_ * e_);
    std::memcpy(cache + value * Dh_ * e_, v, Dh_ * e_);
  }

  // fn((T*)0, (C*)0) for the model's type T and layer s's cache rows C (T, int8 or float8 e4m3)
  template <typename Fn>
  void with_row_types(const LayerSpec& s, Fn&& fn) const {
    auto rows = [&](auto* t) {
      using T = std::remove_pointer_t<decltype(t)>;
      if (!s.kv_scales) fn(t, (T*)nullptr);
      else if (s.kv_fp8) fn(t, (f8e4m3*)nullptr);
      else fn(t, (int8_t*)nullptr);
    };
    if (bf16_) rows((uint16_t*)nullptr);
    else rows((float*)nullptr);
  }

  // task `task` of the attention stage: split s of row b's KV head g -> part_acc_, part_ml_; the last of the
  // (b, g) splits to finish merges them into attn_ (and readies those columns for the o projection). The tasks are
  // the whole context's splits; a sliding-window layer's rows have fewer (its first at the window's start), and a
  // split past them is empty: zero sums and weight, so the merge gives the window's splits' own bits.
  void attention(int64_t l, int64_t task) {
    const int64_t split = task / Hkv_, g = task % Hkv_, G = H_ / Hkv_;
    const int64_t b = split_owner(split_first_, split);
    const int64_t s = split - split_first_[b], n = split_first_[b + 1] - split_first_[b];
    const LayerSpec& spec = layers_[l];
    const int64_t n_real = spec.window > 0 ? num_splits(lens_[b], spec.window) : n;
    // the queries: q_'s row b, or with one row (see step) this task's own copy, laid out as q_'s row 0 would be
    const char* q = q_;
    int64_t q_row = b;
    if (rope_in_attention_) {
      thread_local std::vector<char> own;
      own.resize(H_ * Dh_ * e_);
      rope_queries(l, b, g, own.data() + g * G * Dh_ * e_);
      if (s + 1 == n_real) rope_and_write_kv(l, b, g);  // the split that holds the new token reads its key
      q = own.data(), q_row = 0;
    }
    thread_local std::vector<float> scratch;
    scratch.resize(attention_scratch(G, Dh_, block_size_));
    const float scale = (float)std::pow((double)Dh_, -0.5);
    const int64_t at = split * H_ + g * G;
    float *acc = part_acc_.data() + at * Dh_, *ml = part_ml_.data() + at * 2;
    if (s < n_real) {
      with_row_types(spec, [&](auto* t, auto* c) {
        using T = std::remove_pointer_t<decltype(t)>;
        using C = std::remove_pointer_t<decltype(c)>;
        attention_split<T, C>((const T*)q, (const C*)spec.cache, slots_, tables_ + b * max_blocks_, lens_[b],
                              spec.window, q_row, g, s, H_, Hkv_, Dh_, block_size_, scale, acc, ml, scratch.data(),
                              (const uint16_t*)spec.kv_scales);
      });
    } else {  // past the window's splits: nothing attended
      std::fill(acc, acc + G * Dh_, 0.f);
      for (int64_t j = 0; j < G; ++j) ml[2 * j] = -INFINITY, ml[2 * j + 1] = 0.f;
    }
    if (n > 1) {  // the splits' writes before this one's are visible to whichever finishes last (acq_rel)
      std::atomic<int64_t>& done = splits_done_[b * Hkv_ + g];
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 < n) return;
      done.store(0, std::memory_order_relaxed);  // for the next layer, after this stage
    }
    const int64_t h0 = g * G, first = split_first_[b] * H_;
    if (bf16_) merge_splits<uint16_t>(part_acc_.data() + first * Dh_, part_ml_.data() + first * 2, n, H_, h0, h0 + G,
                                      Dh_, (uint16_t*)attn_ + b * H_ * Dh_, spec.sinks);
    else merge_splits<float>(part_acc_.data() + first * Dh_, part_ml_.data() + first * 2, n, H_, h0, h0 + G, Dh_,
                             (float*)attn_ + b * H_ * Dh_, spec.sinks);
    if (o_split_)  // these query heads' columns of the o projection's input, whole blocks: ready them here
      prep(attn_ + b * H_ * Dh_ * e_, H_ * Dh_, layers_[l].o, b, h0 * Dh_, g + 1 == Hkv_ ? -1 : (h0 + G) * Dh_);
  }

  void post_norm(int64_t l, int64_t b) {
    const LayerSpec& s = layers_[l];
    char* normed = normed_ + b * D_ * e_;
    rmsnorm_rows(act(hidden_, b, D_), act(residual_, b, D_), true, param(s.post_norm), eps_, Act{normed, bf16_}, 1,
                 D_);
    lora_.row_ready(l, StackLoras::GATE_UP, b, Act{normed_, bf16_}, D_);
    if (s.moe < 0) return prep(normed, D_, s.gate_up, b);
    moe_.route(s.moe, b, normed);
    const MoELayer& m = moe_.layer(s.moe);
    if (!pairs_apply(m.gu, bf16_, D_, m.gu_K))
      prep_row(normed, bf16_, D_, m.gu_K, row_prep(m.gu), xq() + b * max_k_);
  }

  // chunk c: columns [k0, k1) of row c / silu_parts_, its part c % silu_parts_ in whole groups of the down
  // projection's rows (the last part runs to I, and its prep to its padded K): one row's SiLU no longer waits on one
  // thread.
  void silu(int64_t l, int64_t c) {
    const LinearSpec& w = layers_[l].down;
    const int64_t group = row_prep(w).group, b = c / silu_parts_, part = c % silu_parts_, blocks = I_ / group;
    const bool last = part + 1 == silu_parts_;
    const int64_t k0 = part * blocks / silu_parts_ * group;
    const int64_t k1 = last ? I_ : (part + 1) * blocks / silu_parts_ * group;
    silu_mul_rows(Act{gate_up_ + (b * 2 * I_ + k0) * e_, bf16_}, Act{act_ + (b * I_ + k0) * e_, bf16_}, 1, I_,
                  k1 - k0);
    prep(act_ + b * I_ * e_, I_, w, b, k0, last ? w[3] : k1);
    lora_.row_ready(l, StackLoras::DOWN, b, Act{act_, bf16_}, I_);  // (a step with adapter rows: a row in one part)
  }

  void final_norm(int64_t b) {
    mlp_out((int64_t)layers_.size() - 1, b);
    rmsnorm_rows(act(hidden_, b, D_), act(residual_, b, D_), true, param(final_norm_), eps_, act(out_, b, D_), 1, D_);
    if (logits_) prep(out_ + b * D_ * e_, D_, head_, b);
  }

  void grow(int64_t B) {
    if (B <= rows_) return;
    const int64_t widths[8] = {D_, D_, D_, (H_ + 2 * Hkv_) * Dh_, H_ * Dh_, H_ * Dh_, 2 * I_, I_};
    for (int i = 0; i < 8; ++i) scratch_[i].assign(B * widths[i] * e_, 0);
    hidden_ = scratch_[0].data(), residual_ = scratch_[1].data(), normed_ = scratch_[2].data();
    qkv_ = scratch_[3].data(), q_ = scratch_[4].data(), attn_ = scratch_[5].data();
    gate_up_ = scratch_[6].data(), act_ = scratch_[7].data();
    xq_.assign(B * std::max(max_k_, pair_row_words(max_k_)) + 16, 0.f);  // (+ 16: xq() on a line's start)
    splits_done_.reset(new std::atomic<int64_t>[B * Hkv_]);
    for (int64_t i = 0; i < B * Hkv_; ++i) splits_done_[i].store(0, std::memory_order_relaxed);
    rows_ = B;
  }

  const bool bf16_;
  const int64_t e_, D_, H_, Hkv_, Dh_, I_;
  const float eps_;
  const int64_t slots_;
  const uintptr_t final_norm_;
  const int64_t threads_;
  // each (row, KV head)'s merge preps its own query heads' columns of the o projection's input (the o_input stage
  // gets no chunks) where they are whole groups of its rows (add_layer). One stage hand-over a layer less.
  bool o_parts_ = (H_ / Hkv_ * Dh_) % QK == 0;
  bool o_split_ = false;  // o_parts_ in this step (not with adapter rows)
  int64_t silu_group_ = QK;  // the largest group of a down projection's rows (add_layer)
  std::vector<LayerSpec> layers_;
  MoEStages moe_;  // the sparse layers' MLPs
  StackLoras lora_;  // the adapters' tables and the step's slot per row
  int64_t max_k_ = 0;
  // scratch, [rows_, width] each, in the model dtype; xq_ the rows for the next linear (prep_row)
  std::vector<char> scratch_[8];
  char *hidden_ = nullptr, *residual_ = nullptr, *normed_ = nullptr, *qkv_ = nullptr, *q_ = nullptr,
       *attn_ = nullptr, *gate_up_ = nullptr, *act_ = nullptr;
  std::vector<float> xq_;
  // xq_ from its first 64-byte line: prep's pair-major rows write whole lines of their own
  float* xq() { return (float*)(((uintptr_t)xq_.data() + 63) & ~(uintptr_t)63); }
  int64_t rows_ = 0;
  // this step's inputs (set by run, read by the stages)
  int64_t B_ = 0, max_blocks_ = 0, block_size_ = 0, silu_parts_ = 1;
  // attention: row b's splits are [split_first_[b], split_first_[b + 1]), Hkv tasks each (task = split * Hkv + g);
  // their sums [splits, H, Dh] and (max, sum) [splits, H, 2], merged by the last of a (row, KV head)'s splits to
  // finish
  std::vector<int64_t> split_first_;
  std::vector<float> part_acc_, part_ml_;
  std::unique_ptr<std::atomic<int64_t>[]> splits_done_;  // [rows_, Hkv]: splits finished this layer, 0 between
  bool rope_in_attention_ = false;
  const char *cos_ = nullptr, *sin_ = nullptr;
  const int64_t *slot_ = nullptr, *tables_ = nullptr, *lens_ = nullptr;
  char *out_ = nullptr, *logits_ = nullptr;
  HeadOutputs head_out_;  // the head's float32 logits and argmax
  std::vector<char> rope_;  // run_ids: cos and sin [B, Dh] (model dtype)
  LinearSpec head_{};
  int64_t emb_format_ = -1, emb_k_ = 0;  // set_packed_embedding's (-1: a table in the model dtype)
};

}  // namespace tmk
