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
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "stack/pool.h"
#include "stack/stages.h"

namespace tmk {

class DecodeStack : StackStages {
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
      : StackStages(bf16, D, H, Hkv, Dh, I, eps, slots, final_norm, threads),
        pool_(std::max(0, threads - 1), num_layers * kStagesPerLayer + 2) {}

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
    pool_.set_stage(base + 7, [this, m](int64_t c) { moe_.gate_up(m, c, normed_, xq(), max_k_); });
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
  Program pool_;
  bool profiling_ = false;
  std::vector<std::vector<double>> marks_;  // the profile: each run's stage boundaries (seconds from its start)
};

}  // namespace tmk
