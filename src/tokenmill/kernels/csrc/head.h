// What the LM head's chunks of a decode step leave beside the logits: for a bf16 model the logits as float32 (the
// sampler's input), widened chunk by chunk while each chunk's columns are in cache (a torch conversion afterwards
// woke its OpenMP threads for ~0.1 ms a step); and each row's argmax over the float32 logits, as torch.argmax takes
// it (the first NaN, else the first maximum): each chunk finds its own columns' winner, and the winners are compared
// in column order at the end (a separate pass over [16, 151936] logits was ~0.6 ms of a 16-row step, Xeon).
//
// Included by kernels.cpp after fused.h (argmax_row), before stack.h.
#pragma once

#include <cstdint>
#include <vector>

namespace tmk {

class HeadOutputs {
 public:
  // A step's: logits [B, V] (bf16 or float32); logits32 [B, V] (used for a bf16 model, else ignored) and argmax [B],
  // each null to skip; `chunks` of the head's columns. The argmax needs float32 logits: the model's, or logits32.
  void begin(int64_t B, int64_t V, bool bf16, const char* logits, float* logits32, int64_t* argmax, int64_t chunks) {
    B_ = B, V_ = V, chunks_ = chunks, logits_ = logits;
    logits32_ = bf16 ? logits32 : nullptr;
    argmax_ = !bf16 || logits32_ ? argmax : nullptr;
    if (argmax_) winners_.resize(B * chunks);
  }

  // after chunk c of the head has written columns [n0, n1) of every row
  void chunk(int64_t c, int64_t n0, int64_t n1) {
    if (logits32_)
      for (int64_t b = 0; b < B_; ++b) {
        const uint16_t* src = (const uint16_t*)logits_ + b * V_;
        float* dst = logits32_ + b * V_;
        int64_t n = n0;
        for (; n + W <= n1; n += W) store(dst + n, load_bf16(src + n));
        for (; n < n1; ++n) dst[n] = load_one(src + n);
      }
    if (argmax_)
      for (int64_t b = 0; b < B_; ++b) winners_[b * chunks_ + c] = n0 + argmax_row(f32() + b * V_ + n0, n1 - n0);
  }

  // after every chunk: the chunks' winners, in column order -> argmax. A NaN ends the search (it is the row's
  // first), else a later chunk wins only with a larger value (equal maxima: the first).
  void finish() {
    if (!argmax_) return;
    for (int64_t b = 0; b < B_; ++b) {
      const float* row = f32() + b * V_;
      const int64_t* won = winners_.data() + b * chunks_;
      int64_t best = won[0];
      for (int64_t c = 1; c < chunks_ && row[best] == row[best]; ++c)
        if (row[won[c]] != row[won[c]] || row[won[c]] > row[best]) best = won[c];
      argmax_[b] = best;
    }
  }

 private:
  const float* f32() const { return logits32_ ? logits32_ : (const float*)logits_; }

  int64_t B_ = 0, V_ = 0, chunks_ = 0;
  const char* logits_ = nullptr;
  float* logits32_ = nullptr;
  int64_t* argmax_ = nullptr;
  std::vector<int64_t> winners_;  // [B, chunks]: each chunk's argmax per row
};

}  // namespace tmk
