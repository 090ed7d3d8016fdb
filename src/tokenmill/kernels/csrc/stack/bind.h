// The decode stack's Python class (kernels.cpp's module calls bind_decode_stack): its calls, and two that take a
// step's inputs as Python lists (run_lists, run_steps) so that no tensor is built for them.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "ops/sample.h"
#include "stack/stack.h"

namespace tmk {

inline void bind_decode_stack(pybind11::module_& m) {
  namespace py = pybind11;
  using nogil = py::call_guard<py::gil_scoped_release>;  // (as kernels.cpp's: a whole step releases the GIL)
  // DecodeStack::run_ids with its integer inputs as Python lists, which pybind copies into vectors before the GIL
  // is released: ids, positions, slots, lens [B] and tables [B * max_blocks]. A torch op's first call after a
  // step's weights have streamed through the caches runs cold code: with these inputs as tensors and the outputs
  // allocated each step, a visible share of a one-row step went outside this call.
  const auto run_lists = [](tmk::DecodeStack& s, uintptr_t embed, int64_t vocab, const std::vector<int64_t>& ids,
                            const std::vector<int64_t>& positions, uintptr_t cos_table, uintptr_t sin_table,
                            const std::vector<int64_t>& slots, const std::vector<int64_t>& tables, int64_t max_blocks,
                            const std::vector<int64_t>& lens, int64_t block_size, uintptr_t out, uintptr_t logits,
                            uintptr_t logits32, uintptr_t argmax) {
    const size_t B = ids.size();
    if (B == 0 || positions.size() != B || slots.size() != B || lens.size() != B || max_blocks < 1 ||
        tables.size() != B * (size_t)max_blocks)
      throw std::invalid_argument("run_lists: ids, positions, slots and lens need one entry per row (>= 1 row), "
                                  "tables max_blocks per row");
    s.run_ids(embed, vocab, (uintptr_t)ids.data(), (uintptr_t)positions.data(), cos_table, sin_table,
              (uintptr_t)slots.data(), (uintptr_t)tables.data(), max_blocks, (uintptr_t)lens.data(), (int64_t)B,
              block_size, out, logits, logits32, argmax);
  };
  // A decode run (models/decode_stack.py, run_steps): R decode steps of B rows, each a run_ids() at positions
  // starts[b] + r fed the last step's tokens (ids: the first step's), from Python lists as run_lists takes them.
  // A step's token is the head's argmax, or, where `temperature` holds each row's draw rule (with top_k, top_p,
  // min_p: the sampler's float32 settings), the row's draw_row over its logits in the model's dtype (`bf16`; V
  // columns) at u[r * B + b], as the sampler's kernel draws a step's. slots [R * B]: step r's at [r B, (r + 1) B);
  // tables [B * max_blocks]. Returns each row's R tokens.
  const auto run_steps = [](tmk::DecodeStack& s, uintptr_t embed, int64_t vocab, std::vector<int64_t> ids,
                            const std::vector<int64_t>& starts, uintptr_t cos_table, uintptr_t sin_table,
                            const std::vector<int64_t>& slots, const std::vector<int64_t>& tables, int64_t max_blocks,
                            int64_t R, int64_t block_size, uintptr_t out, uintptr_t logits, bool bf16, int64_t V,
                            const std::vector<double>& temperature, const std::vector<int64_t>& top_k,
                            const std::vector<double>& top_p, const std::vector<double>& min_p,
                            const std::vector<double>& u) {
    const size_t B = ids.size(), n = temperature.size();
    if (B == 0 || R < 1 || starts.size() != B || slots.size() != B * (size_t)R || max_blocks < 1 ||
        tables.size() != B * (size_t)max_blocks)
      throw std::invalid_argument("run_steps: ids and starts need one entry per row (>= 1 row), slots R per row, "
                                  "tables max_blocks per row");
    if ((n && n != B) || top_k.size() != n || top_p.size() != n || min_p.size() != n || (n && u.size() != B * R))
      throw std::invalid_argument("run_steps: no draw rules, or one per row and one uniform per row and step");
    std::vector<int64_t> positions(B), lens(B), best(B);
    std::vector<std::vector<int64_t>> tokens(B);
    static thread_local tmk::DrawScratch scratch;  // grown to the vocabulary once, kept from call to call
    for (int64_t r = 0; r < R; ++r) {
      for (size_t b = 0; b < B; ++b) positions[b] = starts[b] + r, lens[b] = positions[b] + 1;
      s.run_ids(embed, vocab, (uintptr_t)ids.data(), (uintptr_t)positions.data(), cos_table, sin_table,
                (uintptr_t)(slots.data() + r * B), (uintptr_t)tables.data(), max_blocks, (uintptr_t)lens.data(),
                (int64_t)B, block_size, out, logits, 0, (uintptr_t)best.data());
      for (size_t b = 0; b < B; ++b) {
        if (n) {
          const tmk::DrawRule rule{(float)temperature[b], (float)top_p[b], (float)min_p[b], top_k[b], u[r * B + b]};
          const tmk::Act row{(char*)logits + b * V * (bf16 ? 2 : 4), bf16};
          ids[b] = tmk::draw_row(row, V, rule, nullptr, scratch);
        } else {
          ids[b] = best[b];
        }
        tokens[b].push_back(ids[b]);
      }
    }
    return tokens;
  };
  py::class_<tmk::DecodeStack>(m, "DecodeStack", py::module_local())  // one per variant in a process
      .def(py::init<bool, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t, uintptr_t, int64_t, int>())
      .def("add_layer", &tmk::DecodeStack::add_layer)
      .def("add_sparse_layer", &tmk::DecodeStack::add_sparse_layer)
      .def("set_kv_scales", &tmk::DecodeStack::set_kv_scales)
      .def("set_window", &tmk::DecodeStack::set_window)
      .def("set_sinks", &tmk::DecodeStack::set_sinks)
      .def("num_layers", &tmk::DecodeStack::num_layers)
      .def("set_head", &tmk::DecodeStack::set_head)
      .def("set_lora", &tmk::DecodeStack::set_lora, "a projection's LoRA slot tables (stack/lora.h)")
      .def("set_lora_rows", &tmk::DecodeStack::set_lora_rows, "the next runs' LoRA slot per row (0: none)")
      .def("set_packed_embedding", &tmk::DecodeStack::set_packed_embedding)
      .def("run", &tmk::DecodeStack::run, "a decode step through every layer and the final norm", py::arg("x"),
           py::arg("cos"), py::arg("sin"), py::arg("slot"), py::arg("tables"), py::arg("max_blocks"), py::arg("lens"),
           py::arg("B"), py::arg("block_size"), py::arg("out"), py::arg("logits"), py::arg("logits32") = 0,
           py::arg("argmax") = 0, nogil())
      .def("run_ids", &tmk::DecodeStack::run_ids, "run() from token ids and positions (embedding, rotary tables)",
           nogil())
      .def("run_lists", run_lists, "run_ids() from lists (no tensor built for the step's inputs)", nogil())
      .def("run_greedy", &tmk::DecodeStack::run_greedy, "greedy decoding rounds through the stack and head", nogil())
      .def("run_steps", run_steps, "a decode run: several steps, each fed the last one's tokens (argmax or draws)",
           nogil())
      .def("set_profile", &tmk::DecodeStack::set_profile, "time every stage of every run from now on (or stop)")
      .def("marks", &tmk::DecodeStack::marks, "each profiled run's stage boundaries, seconds from its start")
      .def("stage_of", &tmk::DecodeStack::stage_of, "stage i's kind and layer (-1: after the last layer)");
}

}  // namespace tmk
