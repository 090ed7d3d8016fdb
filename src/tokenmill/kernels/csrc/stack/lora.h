// LoRA adapters in the decode stack (models/lora.py, ops/lora.h): each adapted projection's slot tables, registered
// when adapters come and go, and the step's slot per row. The stage after each adapted linear adds a row's update
// before it reads the row (stack/stack.h): qkv's in the RoPE stage, o's in the post-attention norm, gate|up's in the
// SiLU (a part's columns of each half), down's in the next layer's input norm or the final norm. Each row's update is
// the per-module path's (lora_row), so both paths give the same bits.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/lora.h"

namespace tmk {

class StackLoras {
 public:
  enum Projection { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3 };

  // layer l's projection p takes the adapters of these tables, `slots` long (ranks 0: an adapter that leaves it
  // alone); a, bt, ranks int64 [slots] and scales float32 [slots] (models/lora.py: LoraProjection)
  void set(int64_t l, int p, uintptr_t a, uintptr_t bt, uintptr_t ranks, uintptr_t scales, int64_t slots) {
    if (l < 0 || p < 0 || p > DOWN) throw std::invalid_argument("set_lora: no such layer or projection");
    if ((int64_t)tables_.size() <= l) tables_.resize(l + 1), slots_.resize(l + 1);
    tables_[l][p] = LoraSlots{(const int64_t*)a, (const int64_t*)bt, (const int64_t*)ranks, (const float*)scales};
    slots_[l][p] = slots;
  }

  // the next steps' slot per row (int64 [B]; -1: the base model), or none (ids 0): every slot within every table
  void set_rows(uintptr_t ids, int64_t B) {
    ids_ = (const int64_t*)ids;
    for (int64_t b = 0; ids_ && b < B; ++b) {
      const int64_t slot = ids_[b];
      bool fits = slot >= -1;
      for (const auto& layer : slots_)
        for (int64_t n : layer) fits = fits && (n == 0 || slot < n);
      if (!fits) {
        ids_ = nullptr;
        throw std::out_of_range("LoRA slot " + std::to_string(slot) + " of row " + std::to_string(b) +
                                " is not in the stack's tables");
      }
    }
  }

  bool on() const { return ids_ != nullptr; }

  // row b's update of layer l's projection p (x its input row, out its output row: the model dtype) added into
  // out's columns [n0, n1) of N
  void add(int64_t l, int p, int64_t b, Act x, Act out, int64_t K, int64_t N, int64_t n0, int64_t n1) const {
    if (!ids_ || ids_[b] < 0 || l >= (int64_t)tables_.size() || !slots_[l][p]) return;
    lora_row(x, out, N, K, ids_[b], tables_[l][p], n0, n1);
  }

 private:
  std::vector<std::array<LoraSlots, 4>> tables_;
  std::vector<std::array<int64_t, 4>> slots_;  // 0: the projection takes no adapter
  const int64_t* ids_ = nullptr;
};

}  // namespace tmk
