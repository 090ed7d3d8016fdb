// A decode step's whole decoder stack in one call: for each layer, residual add + RMSNorm, qkv, (q/k norm),
// RoPE, KV write, paged attention, o, residual add + RMSNorm, gate|up, SiLU*mul, down; then the final norm.
//
// The functions the per-module path calls (kernels.cpp, ops/fused.h), applied to the same rows in the same order, so
// both paths give the same numbers; what goes is Python between them: ~15 calls per layer become one per step.
// The layers' weights, norms and KV tensors are registered once (`add_layer`: raw pointers the Python side keeps
// alive); scratch activations live here and are reused from step to step.
//
// Threads: a step is a program of stages (stack/pool.h), ten per layer. Row stages (norms, RoPE + KV write, SiLU*mul)
// take one chunk per sequence; a linear takes chunks of output panels; attention one chunk per (sequence, split of
// its context, KV head) (attention/common.h: splits of kSplit positions), the last split of a (sequence, KV head) to
// finish merging them. With fewer sequences than threads a row's SiLU takes one chunk per thread, and with one
// sequence each attention chunk ropes its own queries, the split holding the new token also its KV head's key, which
// it writes with the value (the RoPE stage gets no chunks).
// Each stage also leaves its output in float32 rows (`xq`), ready for the next linear; attention chunks do so for
// their own heads' columns where those are whole quantization blocks (the o_input stage then gets no chunks).
// LoRA adapters (stack/lora.h): the row stage before an adapted linear leaves each adapter row's scale * A x, and
// each chunk of the linear adds B times that to its columns.
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
#include "stack/pool.h"

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

class DecodeStack {
 public:
  static constexpr int kStagesPerLayer = 10;
  // what each stage does: a layer's ten, then the two after the last layer (the profile's names)
  static constexpr const char* kStageKinds[kStagesPerLayer + 2] = {
      "input_norm", "qkv_proj", "rope_kv_write", "attention", "o_input", "o_proj", "post_norm", "gate_up_proj",
      "silu_mul", "down_proj", "final_norm", "lm_head"};
  // a sparse layer's last four (stack/moe.h)
  static constexpr const char* kSparseKinds[4] = {"post_norm_route", "experts_gate_up", "experts_silu",
                                                  "experts_down"};

  DecodeStack(bool bf16, int64_t D, int64_t H, int64_t Hkv, int64_t Dh, int64_t I, double eps, int64_t slots,
              uintptr_t final_norm, int64_t num_layers, int threads)
      : bf16_(bf16), e_(bf16 ? 2 : 4), D_(D), H_(H), Hkv_(Hkv), Dh_(Dh), I_(I), eps_((float)eps), slots_(slots),
        final_norm_(final_norm), threads_(std::max(1, threads)), moe_(bf16, D), pool_(std::max(0, threads - 1), num_layers * kStagesPerLayer + 2) {}

  void add_layer(uintptr_t in_norm, uintptr_t post_norm, uintptr_t q_norm, uintptr_t k_norm, uintptr_t cache,
                 LinearSpec qkv, LinearSpec o, LinearSpec gate_up, LinearSpec down) {
    const int64_t l = add_attention({in_norm, post_norm, q_norm, k_norm, cache, qkv, o, gate_up, down});
    max_k_ = std::max({max_k_, gate_up[3], down[3]});
    silu_group_ = std::max(silu_group_, row_prep(down).group);
    const int64_t base = l * kStagesPerLayer;
    pool_.set_stage(base + 6, [this, l](int64_t b) { this->post_norm(l, b); });
    pool_.set_stage(base + 7, [this, l](int64_t c) {
      panels(layers_[l].gate_up, c, gate_up_, normed_, D_, l, StackLoras::GATE_UP);
    });
    pool_.set_stage(base + 8, [this, l](int64_t c) { silu(l, c); });
    pool_.set_stage(base + 9, [this, l](int64_t c) {
      panels(layers_[l].down, c, hidden_, act_, I_, l, StackLoras::DOWN);
    });
  }

  // A sparse layer (stack/moe.h): its attention as add_layer's; its MLP the router [E, D] (the model dtype; k of E
  // experts a token, their weights renormalised where `renorm`, float32 where `keep_f32`) and the experts' packed
  // weights (int64 [E] pointers each: gate|up [2 I, gu_K], down [D, dn_K]). gpt-oss's: the router's bias [E] (the
  // model dtype) and the softmax over its top k logits (ops/route.h); the experts' float32 biases (int64 [E]
  // pointers to [2 I] / [D] each) and the clamped SwiGLU at alpha and limit. 0 / false: none of those.
  void add_sparse_layer(uintptr_t in_norm, uintptr_t post_norm, uintptr_t q_norm, uintptr_t k_norm, uintptr_t cache,
                        LinearSpec qkv, LinearSpec o, uintptr_t router, int64_t E, int64_t k, bool renorm,
                        bool keep_f32, uintptr_t gate_up, int64_t gu_format, int64_t gu_K, uintptr_t down,
                        int64_t dn_format, int64_t dn_K, int64_t I, uintptr_t router_bias, bool softmax_after_top_k,
                        uintptr_t gu_bias, uintptr_t dn_bias, bool clamped, double alpha, double limit) {
    const Routing routing{E, k, renorm, keep_f32, (const char*)router_bias, softmax_after_top_k};
    const int64_t m = moe_.add({(const char*)router, routing, (const int64_t*)gate_up, (const int64_t*)down,
                                (Format)gu_format, (Format)dn_format, gu_K, dn_K, I, (const int64_t*)gu_bias,
                                (const int64_t*)dn_bias, clamped, (float)alpha, (float)limit});
    const int64_t l = add_attention({in_norm, post_norm, q_norm, k_norm, cache, qkv, o, {}, {}, m});
    max_k_ = std::max(max_k_, gu_K);
    const int64_t base = l * kStagesPerLayer;
    pool_.set_stage(base + 6, [this, l](int64_t b) { this->post_norm(l, b); });
    pool_.set_stage(base + 7, [this, m](int64_t c) { moe_.gate_up(m, c, normed_, xq_.data(), max_k_); });
    pool_.set_stage(base + 8, [this, m](int64_t r) { moe_.silu(m, r); });
    pool_.set_stage(base + 9, [this, m](int64_t c) { moe_.down(m, c); });
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // Layer l's cache holds int8 (or, with fp8, float8 e4m3) rows with these bf16 scales [2, slots, Hkv]: keys and
  // values are quantized as they are written, and widened where attention reads them (attention/kv_quant.h).
  // Layer l attends to each row's last `window` positions only (a sliding-window layer).
  void set_window(int64_t l, int64_t window) { layers_.at(l).window = window; }
  // Layer l's heads each add a sink logit to their softmax's denominator (sinks [H] float32; gpt-oss): merge_splits.
  void set_sinks(int64_t l, uintptr_t sinks) { layers_.at(l).sinks = (const float*)sinks; }

  void set_kv_scales(int64_t l, uintptr_t scales, bool fp8) {
    layers_.at(l).kv_scales = scales;
    layers_.at(l).kv_fp8 = fp8;
  }

  // The embedding is a quantized weight's panels (its rows unpacked as they are looked up: a GGUF's token_embd,
  // which also serves as a tied LM head), not a table in the model dtype.
  void set_packed_embedding(int64_t format, int64_t K) { emb_format_ = format, emb_k_ = K; }

  // LoRA (stack/lora.h): layer l's projection p (qkv, o, gate_up, down) takes the adapters of these slot tables; and
  // the next runs' slot per row (int64 [B], -1: the base model; 0: no row takes an adapter)
  void set_lora(int64_t l, int p, uintptr_t a, uintptr_t bt, uintptr_t ranks, uintptr_t scales, int64_t slots,
                bool bf16) {
    lora_.set(l, p, a, bt, ranks, scales, slots, bf16);
  }
  void set_lora_rows(uintptr_t ids, int64_t B) { lora_.set_rows(ids, B); }

  // The LM head, run after the final norm when run() is given a logits buffer.
  void set_head(LinearSpec head) {
    head_ = head;
    max_k_ = std::max(max_k_, head[3]);
  }

  // x [B, D] the embedded tokens; cos, sin [B, Dh]; slot [B] each new token's cache slot; tables [B, max_blocks]
  // and lens [B] the paged context (int64) -> out [B, D], the final norm's output, and logits [B, V] (the head's
  // output, in the model dtype) when `logits` is not 0; for a bf16 model, those logits also as float32 in
  // logits32 [B, V] when it is not 0; with `argmax` (int64 [B]), also each row's argmax over the logits (stack/head.h).
  void run(uintptr_t x, uintptr_t cos, uintptr_t sin, uintptr_t slot, uintptr_t tables, int64_t max_blocks,
           uintptr_t lens, int64_t B, int64_t block_size, uintptr_t out, uintptr_t logits, uintptr_t logits32 = 0,
           uintptr_t argmax = 0) {
    grow(B);
    std::memcpy(residual_, (const void*)x, B * D_ * e_);
    step(cos, sin, slot, tables, max_blocks, lens, B, block_size, out, logits, logits32, argmax);
  }

  // As run(), from token ids and positions [B] (int64): the rows of embed [V, D] (model dtype) go straight into
  // the residual stream, and cos and sin are rows of the rotary tables [positions, Dh] (float32), rounded to the
  // model dtype as torch rounds them (nearest even). Those torch ops (an embedding, two gathers, two conversions)
  // were a visible share of a one-row step: on their first call after a step's weights have streamed through the
  // caches, each op's code is cold. A token id outside [0, vocab) raises IndexError, as torch's embedding does,
  // before anything runs.
  void run_ids(uintptr_t embed, int64_t vocab, uintptr_t ids, uintptr_t positions, uintptr_t cos_table,
               uintptr_t sin_table, uintptr_t slot, uintptr_t tables, int64_t max_blocks, uintptr_t lens, int64_t B,
               int64_t block_size, uintptr_t out, uintptr_t logits, uintptr_t logits32, uintptr_t argmax) {
    const int64_t* id = (const int64_t*)ids;
    for (int64_t b = 0; b < B; ++b)
      if (id[b] < 0 || id[b] >= vocab)
        throw std::out_of_range("token id " + std::to_string(id[b]) + " is not in the embedding's " +
                                std::to_string(vocab) + " rows");
    grow(B);
    const int64_t row_bytes = D_ * e_;
    rope_.resize(2 * B * Dh_ * e_);
    char *cos = rope_.data(), *sin = cos + B * Dh_ * e_;
    for (int64_t b = 0; b < B; ++b) {
      embed_row(embed, id[b], residual_ + b * row_bytes);
      const int64_t at = ((const int64_t*)positions)[b] * Dh_;
      const Act c{cos + b * Dh_ * e_, bf16_}, s{sin + b * Dh_ * e_, bf16_};
      for (int64_t i = 0; i < Dh_; ++i) {
        c.set(i, ((const float*)cos_table)[at + i]);
        s.set(i, ((const float*)sin_table)[at + i]);
      }
    }
    step((uintptr_t)cos, (uintptr_t)sin, slot, tables, max_blocks, lens, B, block_size, out, logits, logits32,
         argmax);
  }

  // Profile (off by default, and free when off): every run's stage boundaries while on. marks()[r][i + 1] -
  // marks()[r][i] is how long run r's stage i took, as the calling thread saw it (seconds; what it does:
  // stage_of(i)). Turning it on or off forgets the runs so far.
  void set_profile(bool on) { profiling_ = on, marks_.clear(); }
  const std::vector<std::vector<double>>& marks() const { return marks_; }
  // stage i's kind and layer (-1: after the last layer)
  std::pair<std::string, int64_t> stage_of(int64_t i) const {
    const int64_t body = num_layers() * kStagesPerLayer;
    if (i < body) {
      const int64_t l = i / kStagesPerLayer, j = i % kStagesPerLayer;
      return {layers_[l].moe >= 0 && j >= 6 ? kSparseKinds[j - 6] : kStageKinds[j], l};
    }
    return {kStageKinds[kStagesPerLayer + (i - body)], -1};
  }

  // Greedy decoding, as a draft model proposes: R drafts per row at most. First the catch-up: n0 one-token rows,
  // feed_tok[i] for row feed_seq[i] (each row's tables row), and each row b's first draft is the argmax (as
  // torch.argmax takes it: the first NaN, else the first maximum; found by the head's chunks, as in run) at its
  // feed row feed_last[b]. Then R - 1 chain rounds: round r embeds tokens[b, r] for the rows b < active[r] (rows
  // sorted by their draft count, most first) and writes the argmax to tokens[b, r + 1].
  // embed [V, D] the embedding table (model dtype); tokens [B, R] int64; cos, sin [n0 + (R - 1) B, Dh] and
  // slots, lens [n0 + (R - 1) B] int64: the feed rows', then round r's at n0 + r B; tables [B, max_blocks];
  // out [max(n0, B), D] and logits [max(n0, B), V] scratch (model dtype). Needs the head (set_head).
  void run_greedy(uintptr_t embed, uintptr_t tokens, uintptr_t active, int64_t R, int64_t n0, uintptr_t feed_tok,
                  uintptr_t feed_seq, uintptr_t feed_last, uintptr_t cos, uintptr_t sin, uintptr_t slots,
                  uintptr_t tables, int64_t max_blocks, uintptr_t lens, int64_t B, int64_t block_size, uintptr_t out,
                  uintptr_t logits) {
    int64_t* tok = (int64_t*)tokens;
    const int64_t *rows = (const int64_t*)active, *seq = (const int64_t*)feed_seq;
    const int64_t row_bytes = D_ * e_, rope_bytes = Dh_ * e_;
    std::vector<char> x(std::max(n0, B) * row_bytes);
    std::vector<int64_t> feed_tables(n0 * max_blocks);  // each feed row's sequence's block table
    auto embed_rows = [&](int64_t n, auto token_of) {
      for (int64_t i = 0; i < n; ++i)
        embed_row(embed, token_of(i), x.data() + i * row_bytes);
    };
    embed_rows(n0, [&](int64_t i) { return ((const int64_t*)feed_tok)[i]; });
    for (int64_t i = 0; i < n0; ++i)
      std::memcpy(&feed_tables[i * max_blocks], (const int64_t*)tables + seq[i] * max_blocks, max_blocks * 8);
    std::vector<int64_t> best(std::max(n0, B));  // each row's argmax
    run((uintptr_t)x.data(), cos, sin, slots, (uintptr_t)feed_tables.data(), max_blocks, lens, n0, block_size, out,
        logits, 0, (uintptr_t)best.data());
    for (int64_t b = 0; b < B; ++b) tok[b * R] = best[((const int64_t*)feed_last)[b]];
    for (int64_t r = 0; r + 1 < R && rows[r] > 0; ++r) {
      const int64_t n = rows[r], at = n0 + r * B;
      embed_rows(n, [&](int64_t b) { return tok[b * R + r]; });
      run((uintptr_t)x.data(), cos + at * rope_bytes, sin + at * rope_bytes, slots + at * 8, tables, max_blocks,
          lens + at * 8, n, block_size, out, logits, 0, (uintptr_t)best.data());
      for (int64_t b = 0; b < n; ++b) tok[b * R + r + 1] = best[b];
    }
  }

 private:
  // layer `spec`'s first six stages (its norm and attention), and after it the final norm and head -> its index
  int64_t add_attention(const LayerSpec& spec) {
    const int64_t l = (int64_t)layers_.size();
    layers_.push_back(spec);
    const LinearSpec &qkv = spec.qkv, &o = spec.o;
    max_k_ = std::max({max_k_, qkv[3], o[3]});
    o_parts_ = o_parts_ && (H_ / Hkv_ * Dh_) % row_prep(o).group == 0;
    const int64_t base = l * kStagesPerLayer;
    pool_.set_stage(base + 0, [this, l](int64_t b) { input_norm(l, b); });
    pool_.set_stage(base + 1, [this, l](int64_t c) {
      panels(layers_[l].qkv, c, qkv_, normed_, D_, l, StackLoras::QKV);
    });
    pool_.set_stage(base + 2, [this, l](int64_t b) { rope_and_write(l, b); });
    pool_.set_stage(base + 3, [this, l](int64_t t) { attention(l, t); });
    pool_.set_stage(base + 4, [this, l](int64_t b) {
      prep(attn_ + b * H_ * Dh_ * e_, H_ * Dh_, layers_[l].o, b);
      lora_.row_ready(l, StackLoras::O, b, Act{attn_, bf16_}, H_ * Dh_);
    });
    pool_.set_stage(base + 5, [this, l](int64_t c) {
      panels(layers_[l].o, c, hidden_, attn_, H_ * Dh_, l, StackLoras::O);
    });
    // after the last layer added so far: the final norm, then the LM head (the next layer overwrites both)
    pool_.set_stage(base + kStagesPerLayer, [this](int64_t b) { final_norm(b); });
    pool_.set_stage(base + kStagesPerLayer + 1, [this](int64_t c) {
      panels(head_, c, logits_, out_, D_);
      const auto [begin, end] = chunk_panels(head_, c);
      head_out_.chunk(c, begin * P, std::min(head_[2], end * P));
    });
    return l;
  }

  // run() and run_ids() after the residual stream holds the embedded tokens
  void step(uintptr_t cos, uintptr_t sin, uintptr_t slot, uintptr_t tables, int64_t max_blocks, uintptr_t lens,
            int64_t B, int64_t block_size, uintptr_t out, uintptr_t logits, uintptr_t logits32, uintptr_t argmax) {
    B_ = B, cos_ = (const char*)cos, sin_ = (const char*)sin, slot_ = (const int64_t*)slot;
    tables_ = (const int64_t*)tables, max_blocks_ = max_blocks, lens_ = (const int64_t*)lens;
    block_size_ = block_size, out_ = (char*)out, logits_ = (char*)logits;
    const int64_t head_chunks = logits ? chunks(head_) : 0;
    head_out_.begin(B, head_[2], bf16_, logits_, (float*)logits32, logits ? (int64_t*)argmax : nullptr, head_chunks);
    // fewer rows than threads: each row's SiLU in parts of whole quantization blocks, one thread each
    // (with adapter rows, one part a row: its xa for the down projection reads the whole row)
    const bool parts = B < threads_ && !lora_.on();
    silu_parts_ = parts ? std::max<int64_t>(1, std::min<int64_t>(threads_, I_ / silu_group_)) : 1;
    o_split_ = o_parts_ && !lora_.on();  // (adapter rows: the o_input stage leaves each row's xa for o)
    // attention: each row's splits (attention/common.h), one task each
    split_offsets(lens_, B, 0, split_first_);
    // each (row, KV head)'s count of finished splits starts at 0 (it is back at 0 after every layer, unless a step
    // failed inside attention)
    for (int64_t i = 0; i < B * Hkv_; ++i) splits_done_[i].store(0, std::memory_order_relaxed);
    part_acc_.resize(split_first_[B] * H_ * Dh_), part_ml_.resize(split_first_[B] * H_ * 2);
    // one row: each attention task ropes its own copy of its KV head's queries, and the split that holds the new
    // token also its key, which it writes to the cache with the value, where the rope stage would (that stage then
    // gets no chunks). Not with several rows: rows of a verified draft read each other's keys.
    rope_in_attention_ = B == 1;
    const int64_t L = num_layers();
    moe_.begin(B);
    for (int64_t l = 0; l < L; ++l) {
      const LayerSpec& s = layers_[l];
      const int64_t base = l * kStagesPerLayer, m = s.moe;
      const int64_t counts[kStagesPerLayer] = {B, chunks(s.qkv), rope_in_attention_ ? 0 : B, split_first_[B] * Hkv_,
                                              o_split_ ? 0 : B, chunks(s.o), B,
                                              m < 0 ? chunks(s.gate_up) : moe_.gate_up_chunks(m),
                                              m < 0 ? B * silu_parts_ : moe_.silu_chunks(m),
                                              m < 0 ? chunks(s.down) : moe_.down_chunks(m)};
      for (int i = 0; i < kStagesPerLayer; ++i) pool_.set_chunks(base + i, counts[i]);
    }
    pool_.set_chunks(L * kStagesPerLayer, B);
    pool_.set_chunks(L * kStagesPerLayer + 1, head_chunks);
    const int64_t count = L * kStagesPerLayer + (logits_ ? 2 : 1);
    if (!profiling_) {
      pool_.run(count);
    } else {
      std::vector<double> marks(count + 1);
      pool_.run(count, marks.data());
      for (int64_t i = count; i >= 0; --i) marks[i] -= marks[0];
      marks_.push_back(std::move(marks));
    }
    head_out_.finish();
  }

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

  // row b of `src` (width Kx, the model dtype) -> xq_ row b, ready for linear `w` (unless the bf16 pair tiles read
  // src itself); only its columns [k0, k1) where k1 >= 0 (multiples of the rows' group, as prep_row)
  void prep(const char* src, int64_t Kx, const LinearSpec& w, int64_t b, int64_t k0 = 0, int64_t k1 = -1) {
    if (!pairs_apply((Format)w[1], bf16_, Kx, w[3]))
      prep_row(src, bf16_, Kx, w[3], row_prep(w), xq_.data() + b * max_k_, k0, k1);
  }

  // output panels of chunk c of linear `w`, from the xq_ rows (max_k_ floats apart), or for a bf16 model from its
  // input rows `src` (`width` wide, the model dtype) where the bf16 pair tiles apply; then, for layer l's projection
  // p (l >= 0: stack/lora.h), the adapter rows' updates of those columns
  void panels(const LinearSpec& w, int64_t c, char* out, const char* src, int64_t width, int64_t l = -1, int p = 0) {
    const auto [begin, end] = chunk_panels(w, c);
    linear_spec_range(w, xq_.data(), B_, max_k_, bf16_ ? nullptr : (float*)out, bf16_ ? (uint16_t*)out : nullptr,
                      begin, end, bf16_ ? (const uint16_t*)src : nullptr, width);
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
      prep_row(normed, bf16_, D_, m.gu_K, row_prep(m.gu), xq_.data() + b * max_k_);
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
    if (!pairs_apply((Format)w[1], bf16_, I_, w[3]))
      prep_row(act_ + b * I_ * e_, bf16_, I_, w[3], row_prep(w), xq_.data() + b * max_k_, k0, last ? w[3] : k1);
    lora_.row_ready(l, StackLoras::DOWN, b, Act{act_, bf16_}, I_);  // (a step with adapter rows: a row in one part)
  }

  void final_norm(int64_t b) {
    mlp_out(num_layers() - 1, b);
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
    xq_.assign(B * max_k_, 0.f);
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
  Program pool_;
  // scratch, [rows_, width] each, in the model dtype; xq_ the rows for the next linear (prep_row)
  std::vector<char> scratch_[8];
  char *hidden_ = nullptr, *residual_ = nullptr, *normed_ = nullptr, *qkv_ = nullptr, *q_ = nullptr,
       *attn_ = nullptr, *gate_up_ = nullptr, *act_ = nullptr;
  std::vector<float> xq_;
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
  bool profiling_ = false;
  std::vector<std::vector<double>> marks_;  // the profile: each run's stage boundaries (seconds from its start)
};

}  // namespace tmk
