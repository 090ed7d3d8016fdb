// What the LM head's chunks of a decode step leave beside the logits: for a bf16 model the logits as float32 (the
// sampler's input), widened chunk by chunk while each chunk's columns are in cache (a torch conversion afterwards
// woke its OpenMP threads); and each row's argmax over the logits as float32, as torch.argmax
// takes it (the first NaN, else the first maximum): each chunk finds its own columns' winner, and the winners are
// compared in column order at the end (a separate pass over the logits would read them from memory again).
// Widening bf16 is exact, so the argmax is the same with or without the float32 copy.
#pragma once

#include <cstdint>
#include <vector>

#include "core/simd.h"
#include "ops/fused.h"  // Act, argmax_row

namespace tmk {

class HeadOutputs {
 public:
  // A step's: logits [B, V] (bf16 or float32); logits32 [B, V] (for a bf16 model, else ignored) and argmax [B], each
  // null to skip; `chunks` of the head's columns.
  void begin(int64_t B, int64_t V, bool bf16, const char* logits, float* logits32, int64_t* argmax, int64_t chunks) {
    B_ = B, V_ = V, chunks_ = chunks, bf16_ = bf16, logits_ = logits;
    logits32_ = bf16 ? logits32 : nullptr;
    argmax_ = argmax;
    if (argmax_) winners_.resize(B * chunks);
  }

  // after chunk c of the head has written columns [n0, n1) of every row
  void chunk(int64_t c, int64_t n0, int64_t n1) {
    thread_local std::vector<float> widened;  // a bf16 row's columns, where no float32 copy is kept
    for (int64_t b = 0; b < B_; ++b) {
      const float* row = nullptr;  // columns [n0, n1) of row b as float32
      if (!bf16_) {
        row = (const float*)logits_ + b * V_ + n0;
      } else if (logits32_ || argmax_) {
        float* dst = logits32_ ? logits32_ + b * V_ + n0 : (widened.resize(n1 - n0), widened.data());
        const Act src = logits_row(b);
        int64_t n = n0;
        for (; n + W <= n1; n += W) store(dst + n - n0, src.getv(n));
        for (; n < n1; ++n) dst[n - n0] = src.get(n);
        row = dst;
      }
      if (argmax_) winners_[b * chunks_ + c] = n0 + argmax_row(row, n1 - n0);
    }
  }

  // after every chunk: the chunks' winners, in column order -> argmax. A NaN ends the search (it is the row's
  // first), else a later chunk wins only with a larger value (equal maxima: the first).
  void finish() {
    if (!argmax_) return;
    for (int64_t b = 0; b < B_; ++b) {
      const int64_t* won = winners_.data() + b * chunks_;
      const Act row = logits_row(b);
      int64_t best = won[0];
      float top = row.get(best);
      for (int64_t c = 1; c < chunks_ && top == top; ++c) {
        const float v = row.get(won[c]);
        if (v != v || v > top) best = won[c], top = v;
      }
      argmax_[b] = best;
    }
  }

 private:
  // row b of the logits, in the model dtype
  Act logits_row(int64_t b) const { return Act{(char*)logits_ + b * V_ * (bf16_ ? 2 : 4), bf16_}; }

  int64_t B_ = 0, V_ = 0, chunks_ = 0;
  bool bf16_ = false;
  const char* logits_ = nullptr;
  float* logits32_ = nullptr;
  int64_t* argmax_ = nullptr;
  std::vector<int64_t> winners_;  // [B, chunks]: each chunk's argmax per row
};

}  // namespace tmk
