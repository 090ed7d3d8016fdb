// LoRA adapters in the decode stack (models/lora.py, ops/lora.h): each adapted projection's slot tables, registered
// when adapters come and go, and the step's slot per row, its rows grouped by adapter. A row's update is
// scale * B (A x): in the row stage before each adapted linear, the last row of an adapter's group to have its input
// whole computes xa = scale * A x for the group's rows (`row_ready`: A read once for them); each chunk of the linear's
// output panels then adds B xa to its columns for every group (`add_columns`: a chunk's slice of B^T read once for
// them). The sums are lora_rows' (the module path's), so both paths give the same bits.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/lora.h"

namespace tmk {

class StackLoras {
 public:
  enum Projection { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3 };

  // layer l's projection p takes the adapters of these tables, `slots` long (0: no adapter targets it; ranks 0: a
  // slot's adapter leaves it alone); a, bt, ranks int64 [slots] and scales float32 [slots] (models/lora.py), the
  // matrices in bfloat16 where `bf16`
  void set(int64_t l, int p, uintptr_t a, uintptr_t bt, uintptr_t ranks, uintptr_t scales, int64_t slots, bool bf16) {
    if (l < 0 || p < 0 || p > DOWN) throw std::invalid_argument("set_lora: no such layer or projection");
    if ((int64_t)tables_.size() <= l) tables_.resize(l + 1), slots_.resize(l + 1);
    tables_[l][p] =
        LoraSlots{(const int64_t*)a, (const int64_t*)bt, (const int64_t*)ranks, (const float*)scales, bf16};
    slots_[l][p] = slots;
  }

  // the next runs' slot per row (int64 [B]; -1: the base model), or none (ids 0); a slot past a table raises
  void set_rows(uintptr_t ids, int64_t B) {
    on_ = false, rank_ = 0, groups_.clear(), group_of_.assign(B, -1);
    const int64_t* id = (const int64_t*)ids;
    for (int64_t b = 0; id && b < B; ++b) {
      bool fits = id[b] >= -1;
      for (size_t l = 0; l < tables_.size(); ++l)
        for (int p = 0; p <= DOWN; ++p) {
          fits = fits && (slots_[l][p] == 0 || id[b] < slots_[l][p]);
          if (fits && id[b] >= 0 && slots_[l][p]) rank_ = std::max(rank_, tables_[l][p].ranks[id[b]]);
        }
      if (!fits)
        throw std::out_of_range("LoRA slot " + std::to_string(id[b]) + " of row " + std::to_string(b) +
                                " is not in the stack's tables");
      if (id[b] < 0) continue;
      auto same = std::find_if(groups_.begin(), groups_.end(), [&](const Group& g) { return g.slot == id[b]; });
      if (same == groups_.end()) same = groups_.insert(groups_.end(), Group{id[b], {}, 0});
      group_of_[b] = same - groups_.begin();
      same->rows.push_back(b);
    }
    for (size_t g = 1; g < groups_.size(); ++g) groups_[g].first = groups_[g - 1].first + groups_[g - 1].rows.size();
    on_ = id != nullptr, rows_ = B;
    xa_.assign(4 * B * rank_, 0.f);
    ready_.reset(new std::atomic<int64_t>[4 * std::max<size_t>(1, groups_.size())]);
    for (size_t i = 0; i < 4 * std::max<size_t>(1, groups_.size()); ++i) ready_[i].store(0, std::memory_order_relaxed);
  }

  bool on() const { return on_; }

  // row b of layer l's projection p's input is whole (x: the input's rows, K values of the model dtype apart); the
  // last of its group's rows to be computes the group's xa
  void row_ready(int64_t l, int p, int64_t b, Act x, int64_t K) {
    const int64_t g = on_ ? group_of_[b] : -1;
    if (g < 0 || !adapted(l, p)) return;
    const Group& group = groups_[g];
    const int64_t n = (int64_t)group.rows.size();
    if (n > 1) {  // the other rows' writes are visible to whichever is last (acq_rel)
      std::atomic<int64_t>& ready = ready_[p * groups_.size() + g];
      if (ready.fetch_add(1, std::memory_order_acq_rel) + 1 < n) return;
      ready.store(0, std::memory_order_relaxed);  // for the next layer, after this stage
    }
    lora_xa(x, K, group.rows.data(), n, K, group.slot, tables_[l][p], xa(p, group));
  }

  // every adapter row's update of layer l's projection p added into its columns [n0, n1) of out [B, N] (the model
  // dtype), once the linear has written them
  void add_columns(int64_t l, int p, Act out, int64_t N, int64_t n0, int64_t n1) {
    if (!on_ || !adapted(l, p)) return;
    const LoraSlots& s = tables_[l][p];
    for (const Group& g : groups_)
      lora_out(xa(p, g), s.ranks[g.slot], g.rows.data(), (int64_t)g.rows.size(), Act{(void*)s.bt[g.slot], s.bf16}, N,
               out, n0, n1);
  }

 private:
  struct Group {
    int64_t slot;
    std::vector<int64_t> rows;  // the step's rows that take it, in order
    int64_t first;              // rows of the groups before it
  };

  bool adapted(int64_t l, int p) const { return l < (int64_t)tables_.size() && slots_[l][p] > 0; }
  float* xa(int p, const Group& g) { return &xa_[(p * rows_ + g.first) * rank_]; }

  std::vector<std::array<LoraSlots, 4>> tables_;
  std::vector<std::array<int64_t, 4>> slots_;  // 0: the projection takes no adapter
  bool on_ = false;
  int64_t rows_ = 0, rank_ = 0;     // this step's rows and its adapters' largest rank
  std::vector<Group> groups_;       // this step's rows by adapter slot
  std::vector<int64_t> group_of_;   // [rows]: each row's group, -1: the base model
  std::vector<float> xa_;           // [4 projections, rows by group, rank]: scale * A x, a group's [n, its r] at first
  std::unique_ptr<std::atomic<int64_t>[]> ready_;  // [4, groups]: rows whose input is whole, this layer
};

}  // namespace tmk
