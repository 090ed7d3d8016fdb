// tokenmill's CPU kernels: linear layers over packed bf16 / Q8_0 / Q4_0 weights, built once per ISA (TM_W lanes)
// by kernels/build.py. Threads come from torch's own OpenMP pool through at::parallel_for.
//
// The functions take raw pointers (Python passes tensor.data_ptr(); kernels/ops.py checks shapes and dtypes):
// without torch's tensor headers a variant compiles in seconds instead of a minute.
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention/decode.h"
#include "attention/prefill_run.h"
#include "core/simd.h"
#include "linear/experts.h"
#include "linear/format.h"
#include "linear/linear.h"
#include "linear/qrow.h"
#include "linear/repack.h"
#include "linear/type_traits.h"
#include "ops/fused.h"
#include "ops/logprobs.h"
#include "ops/lora.h"
#include "ops/peak.h"
#include "ops/sample.h"
#include "stack/pool.h"
#include "stack/bind.h"

namespace tmk {

// out[M, N] = x[M, Kx] @ w^T (+ bias): x and out bfloat16 (`bf16` true) or float32, bias float32 or none;
// the weight packed in `format` with N outputs and K inputs (Kx <= K: K padded to whole blocks); `group`: k per
// activation scale where a fused projection's segments ask for more than this format's (linear/segments.h), else 0
void linear(uintptr_t x_ptr, bool bf16, int64_t M, int64_t Kx, uintptr_t w_ptr, int64_t format, int64_t N, int64_t K,
            uintptr_t bias_ptr, uintptr_t out_ptr, int64_t group) {
  const auto F = static_cast<Format>(format);
  RowPrep how = row_prep(F);
  how.group = std::max(how.group, group);
  const int64_t e = bf16 ? 2 : 4;
  thread_local std::vector<float> xf;  // activations as the kernels read them, reused from call to call
  const bool pairs = pairs_apply(F, bf16, Kx, K);
  xf.resize(pairs ? 0 : M * K);
  float* xf_ptr = xf.data();  // (a thread_local named in the lambda is the worker's own)
  if (!pairs)
    at::parallel_for(0, M, std::max<int64_t>(1, (64 << 10) / K), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) prep_row((const char*)x_ptr + i * Kx * e, bf16, Kx, K, how, xf_ptr + i * K);
    });
  const float* bias = (const float*)bias_ptr;
  float* o32 = bf16 ? nullptr : (float*)out_ptr;
  uint16_t* o16 = bf16 ? (uint16_t*)out_ptr : nullptr;
  const uint8_t* w = (const uint8_t*)w_ptr;
  // NOTE: a chunk of at least ~256 KB of weight reads (more with more rows) per thread: a smaller matrix runs on
  // the calling thread alone, because waking a second thread costs more than it saves
  const int64_t n_panels = (N + P - 1) / P;
  const uint16_t* xh = bf16 ? (const uint16_t*)x_ptr : nullptr;  // [M, Kx] bfloat16: the pair tiles' input
  // where the pair tiles take the rows, pair-major (linear/pair_rows.h: a lone row is that already)
  const bool pair_major = takes_pair_major(F, bf16, Kx, K, M);
  thread_local std::vector<int32_t> xp;
  if (pair_major && M > 1) {
    xp.resize(M * pair_row_words(K));
    int32_t* xp_ptr = xp.data();
    at::parallel_for(0, M, std::max<int64_t>(1, (64 << 10) / K), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) write_pairs(xh + i * Kx, M, K, i, xp_ptr);
    });
    xh = (const uint16_t*)xp_ptr;
  }
  at::parallel_for(0, n_panels, panels_per_chunk(F, K, M, 256 << 10), [&](int64_t begin, int64_t end) {
    linear_range(F, xf_ptr, M, K, w, N, K, bias, o32, o16, begin, end, xh, Kx, pair_major);
  });
}

// float32 x[M, K] (K a multiple of `group`: 32, or 256 for the K-quants) -> d[M, K/32] float32 and q[M, K] int8, as
// the quantized linears see x
void quantize_rows(uintptr_t x_ptr, int64_t M, int64_t K, uintptr_t d_ptr, uintptr_t q_ptr, int64_t group) {
  std::vector<float> row(K);
  const int64_t nb = K / QK;
  for (int64_t m = 0; m < M; ++m) {
    quantize_row((const float*)x_ptr + m * K, K, row.data(), false, 0, -1, group);
    std::memcpy((float*)d_ptr + m * nb, row.data(), nb * 4);
    std::memcpy((int8_t*)q_ptr + m * K, qrow(row.data(), nb).q, K);
  }
}

// A GGUF tensor's rows of ggml blocks (row_bytes apart, format's ggml type) -> the packed weight at dst
// (linear/repack.h), the panels split across threads
void repack_gguf(uintptr_t src, int64_t format, int64_t N, int64_t K, int64_t row_bytes, uintptr_t dst) {
  const auto F = static_cast<Format>(format);
  at::parallel_for(0, (N + P - 1) / P, 16, [&](int64_t begin, int64_t end) {
    repack_panels(F, (const uint8_t*)src, row_bytes, N, K, (uint8_t*)dst, begin, end);
  });
}

// rows ids[0..T) (int64) of a packed quantized weight [N, K] as float32 out[T, K]: an embedding in its blocks
void unpack_rows_py(uintptr_t w_ptr, int64_t format, int64_t K, uintptr_t ids, int64_t T, uintptr_t out) {
  const auto F = static_cast<Format>(format);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    unpack_rows(F, (const uint8_t*)w_ptr, K, (const int64_t*)ids + begin, end - begin, (float*)out + begin * K);
  });
}

// The packed weight back as float32 out[N, K] (the prefill path multiplies it with torch's own GEMM)
void unpack(uintptr_t w_ptr, int64_t format, int64_t N, int64_t K, uintptr_t out_ptr) {
  const auto F = static_cast<Format>(format);
  float* o = (float*)out_ptr;
  const uint8_t* w = (const uint8_t*)w_ptr;
  const int64_t n_panels = (N + P - 1) / P, stride = panel_bytes(F, K);
  const auto to_float = format_kernels(F).unpack;
  at::parallel_for(0, n_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      to_float(w + p * stride, K, std::min<int64_t>(P, N - p * P), o + p * P * K);
  });
}

// -- the fused decode ops (ops/fused.h): rows split across threads only when there are enough to pay for it -----------
void rmsnorm(uintptr_t x, uintptr_t residual, uintptr_t weight, bool bf16, double eps, uintptr_t out, int64_t rows,
             int64_t D) {
  const Act xa{(void*)x, bf16}, ra{(void*)residual, bf16}, wa{(void*)weight, bf16}, oa{(void*)out, bf16};
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t begin, int64_t end) {
    const int64_t off = begin * D;
    auto shift = [&](Act a) { return Act{(char*)a.ptr + off * (bf16 ? 2 : 4), bf16}; };
    rmsnorm_rows(shift(xa), residual ? shift(ra) : ra, residual != 0, wa, (float)eps, shift(oa), end - begin, D);
  });
}

void rope(uintptr_t x, uintptr_t cos, uintptr_t sin, bool bf16, int64_t T, int64_t heads, int64_t Dh,
          int64_t row_stride) {
  const Act xa{(void*)x, bf16}, ca{(void*)cos, bf16}, sa{(void*)sin, bf16};
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / (heads * Dh)), [&](int64_t begin, int64_t end) {
    const int64_t e = bf16 ? 2 : 4;
    rope_rows(Act{(char*)xa.ptr + begin * row_stride * e, bf16}, Act{(char*)ca.ptr + begin * Dh * e, bf16},
              Act{(char*)sa.ptr + begin * Dh * e, bf16}, end - begin, heads, Dh, row_stride);
  });
}

void clamped_swiglu(uintptr_t gate_up, uintptr_t out, bool bf16, int64_t rows, int64_t I, double alpha, double limit) {
  const int64_t e = bf16 ? 2 : 4;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, I)), [&](int64_t begin, int64_t end) {
    clamped_swiglu_rows(Act{(char*)gate_up + begin * 2 * I * e, bf16}, Act{(char*)out + begin * I * e, bf16},
                        end - begin, I, (float)alpha, (float)limit);
  });
}

void silu_mul(uintptr_t gate_up, uintptr_t out, bool bf16, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    const int64_t e = bf16 ? 2 : 4;
    silu_mul_rows(Act{(char*)gate_up + begin * 2 * I * e, bf16}, Act{(char*)out + begin * I * e, bf16},
                  end - begin, I);
  });
}

// Every sequence's splits of each KV head as tasks, then each sequence's merge (attention/decode.h)
template <typename T, typename C = T>
void decode_attention_impl(uintptr_t q, uintptr_t cache, int64_t slots, const int64_t* tab, int64_t max_blocks,
                           const int64_t* len, int64_t B, int64_t H, int64_t Hkv, int64_t Dh, int64_t block_size,
                           float scale, int64_t window, uintptr_t out, const float* sinks,
                           const uint16_t* kv_scales = nullptr) {
  const int64_t G = H / Hkv;
  std::vector<int64_t> first;  // sequence b's splits are [first[b], first[b + 1]), Hkv tasks each
  split_offsets(len, B, window, first);
  // each split's sums and (max, sum): [splits, H, Dh] and [splits, H, 2], every element written before it is read
  std::unique_ptr<float[]> acc(new float[first[B] * H * Dh]), ml(new float[first[B] * H * 2]);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (kSplit * G * Dh));  // see linear
  at::parallel_for(0, first[B] * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(attention_scratch(G, Dh, block_size));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t split = task / Hkv, g = task % Hkv, at = split * H + g * G;
      const int64_t b = split_owner(first, split), s = split - first[b];
      attention_split<T, C>((const T*)q, (const C*)cache, slots, tab + b * max_blocks, len[b], window, b, g, s, H, Hkv,
                            Dh, block_size, scale, acc.get() + at * Dh, ml.get() + at * 2, scratch.data(), kv_scales);
    }
  });
  at::parallel_for(0, B, std::max<int64_t>(1, (16 << 10) / (H * Dh)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      merge_splits<T>(acc.get() + first[b] * H * Dh, ml.get() + first[b] * H * 2, first[b + 1] - first[b], H, 0, H, Dh,
                      (T*)out + b * H * Dh, sinks);
  });
}

// fn((T*)0, (C*)0) for the activations' type T (bf16 as uint16_t, or float) and the cache's C: T itself without
// kv_scales, else int8 or float8 e4m3 rows with bf16 scales [2, slots, Hkv] (attention/kv_quant.h)
template <typename Fn>
void with_kv_types(bool bf16, uintptr_t kv_scales, bool fp8, Fn&& fn) {
  auto cache = [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    if (!kv_scales) fn(t, (T*)nullptr);
    else if (fp8) fn(t, (f8e4m3*)nullptr);
    else fn(t, (int8_t*)nullptr);
  };
  if (bf16) cache((uint16_t*)nullptr);
  else cache((float*)nullptr);
}

void decode_attention(uintptr_t q, uintptr_t cache, bool bf16, int64_t slots, uintptr_t tables, int64_t max_blocks,
                      uintptr_t lens, int64_t B, int64_t H, int64_t Hkv, int64_t Dh, int64_t block_size, double scale,
                      int64_t window, uintptr_t out, uintptr_t sinks, uintptr_t kv_scales, bool fp8) {
  with_kv_types(bf16, kv_scales, fp8, [&](auto* t, auto* c) {
    using T = std::remove_pointer_t<decltype(t)>;
    using C = std::remove_pointer_t<decltype(c)>;
    decode_attention_impl<T, C>(q, cache, slots, (const int64_t*)tables, max_blocks, (const int64_t*)lens, B, H, Hkv,
                                Dh, block_size, scale, window, out, (const float*)sinks, (const uint16_t*)kv_scales);
  });
}

// every prefill sequence's new tokens over its paged context (attention/prefill.h); seqs [S, 3] int64: first row
// in q, new tokens, context length
void prefill_attention(uintptr_t q, int64_t q_stride, uintptr_t cache, bool bf16, int64_t slots, uintptr_t tables,
                       int64_t max_blocks, int64_t block_size, uintptr_t seqs, int64_t S, int64_t H, int64_t Hkv,
                       int64_t Dh, double scale, int64_t window, uintptr_t out, uintptr_t sinks, uintptr_t kv_scales,
                       bool fp8) {
  with_kv_types(bf16, kv_scales, fp8, [&](auto* t, auto* c) {
    using T = std::remove_pointer_t<decltype(t)>;
    using C = std::remove_pointer_t<decltype(c)>;
    const PrefillJob<T, C> job{(const T*)q, q_stride, (const C*)cache, slots, (const int64_t*)tables, max_blocks,
                               block_size, (const int64_t*)seqs, H, Hkv, Dh, (float)scale, window, (T*)out,
                               (const float*)sinks, (const uint16_t*)kv_scales};
    prefill_attention_run(job, S);
  });
}

// new keys and values into their cache slots; a quantized cache's rows quantized, their scales beside them
void kv_write(uintptr_t k, int64_t k_stride, uintptr_t v, int64_t v_stride, bool bf16, uintptr_t cache, int64_t slots,
              uintptr_t slot, int64_t n, int64_t width, uintptr_t kv_scales, bool fp8, int64_t Dh) {
  const int64_t* s = (const int64_t*)slot;
  with_kv_types(bf16, kv_scales, fp8, [&](auto* t, auto* c) {
    using T = std::remove_pointer_t<decltype(t)>;
    using C = std::remove_pointer_t<decltype(c)>;
    if constexpr (kv_quantized<C>)
      kv_write_rows_quant((const T*)k, k_stride, (const T*)v, v_stride, (C*)cache, (uint16_t*)kv_scales, slots, s, n,
                          width / Dh, Dh);
    else
      kv_write_rows((const T*)k, k_stride, (const T*)v, v_stride, (T*)cache, slots, s, n, width);
  });
}

// every row's LoRA update added into out [T, N] (ops/lora.h): ids [T] int64 each row's slot (-1: none); a, bt,
// ranks [slots] int64 and scales [slots] float32 the projection's tables (the matrices in bfloat16 where tables_bf16)
void lora_add(uintptr_t x, int64_t ldx, bool bf16, uintptr_t out, int64_t T, int64_t N, int64_t K, uintptr_t ids,
              uintptr_t a, uintptr_t bt, uintptr_t ranks, uintptr_t scales, int64_t slots, bool tables_bf16) {
  for (int64_t t = 0; t < T; ++t)  // checked before any row is written (the threads below could not raise)
    if (((const int64_t*)ids)[t] >= slots)
      throw std::invalid_argument("a row's LoRA slot " + std::to_string(((const int64_t*)ids)[t]) + " is past the " +
                              std::to_string(slots) + " slots of the tables");
  const LoraSlots s{(const int64_t*)a, (const int64_t*)bt, (const int64_t*)ranks, (const float*)scales, tables_bf16};
  at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
    lora_rows(Act{(void*)x, bf16}, ldx, Act{(void*)out, bf16}, N, K, (const int64_t*)ids, s, begin, end);
  });
}

// Stream `bytes` of memory once and return their float sum: the machine's read bandwidth, as the GEMVs see it.
double read_sum(uintptr_t ptr, int64_t bytes) {
  const float* p = (const float*)ptr;
  const int64_t n = bytes / 4, chunk = 1 << 16;
  std::vector<double> partial((n + chunk - 1) / chunk, 0.0);
  at::parallel_for(0, (int64_t)partial.size(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      vf s0 = {}, s1 = {}, s2 = {}, s3 = {};
      const int64_t lo = c * chunk, hi = std::min(n, lo + chunk);
      int64_t i = lo;
      for (; i + 4 * W <= hi; i += 4 * W) {
        s0 += load(p + i);
        s1 += load(p + i + W);
        s2 += load(p + i + 2 * W);
        s3 += load(p + i + 3 * W);
      }
      float r = hsum(s0 + s1 + s2 + s3);
      for (; i < hi; ++i) r += p[i];
      partial[c] = r;
    }
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

// out[b] = argmax of logits [B, V] float32's row b (int64), rows split across threads
void argmax_rows(uintptr_t logits, int64_t B, int64_t V, uintptr_t out) {
  at::parallel_for(0, B, std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, V)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) ((int64_t*)out)[b] = argmax_row((const float*)logits + b * V, V);
  });
}

// Structured output: logits [B, V] float32 whose bit in mask [B, W] (int32 words, bit t of word w = token
// 32 w + t) is clear become -inf, in place; tokens past 32 W too. A word of all ones (a free row) is skipped.
void apply_bitmask(uintptr_t logits, uintptr_t mask, int64_t B, int64_t V, int64_t W) {
  for (int64_t b = 0; b < B; ++b) {
    float* row = (float*)logits + b * V;
    const uint32_t* words = (const uint32_t*)mask + b * W;
    for (int64_t w = 0; w < W && w * 32 < V; ++w) {
      const uint32_t word = words[w];
      if (word == 0xffffffffu) continue;
      const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
      for (int64_t t = 0; t < n; ++t)
        if (!((word >> t) & 1u)) row[base + t] = -INFINITY;
    }
    for (int64_t v = W * 32; v < V; ++v) row[v] = -INFINITY;
  }
}

}  // namespace tmk

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  // a whole step releases the GIL: the server's event loop runs meanwhile (a single small op would not pay for it)
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("linear", &tmk::linear, "out = x @ packed_weight^T (+ bias), on raw pointers");
  m.def("moe_routed", &tmk::moe_routed, "a MoE layer's chosen experts and their weighted sum (linear/experts.h)");
  m.def("moe_release_scratch", &tmk::moe_release_scratch, "let go of this thread's moe_routed buffers (idle)");
  m.def("moe_route", &tmk::moe_route, "a MoE router's top-k experts and weights per token (ops/route.h)");
  m.def("unpack", &tmk::unpack, "packed weight -> float32 [N, K], on raw pointers");
  m.def("unpack_rows", &tmk::unpack_rows_py, "rows of a packed quantized weight -> float32 [T, K], raw pointers");
  m.def("repack_gguf", &tmk::repack_gguf, "a GGUF tensor's ggml blocks -> the packed weight, on raw pointers");
  m.def("quantize_rows", &tmk::quantize_rows, "float32 rows -> their Q8_0 scales and values (the quantized linears)");
  m.def("rmsnorm", &tmk::rmsnorm, "residual += x (if given); out = rmsnorm(.) * weight");
  m.def("rope", &tmk::rope, "rotate-half RoPE in place");
  m.def("silu_mul", &tmk::silu_mul, "silu(gate) * up");
  m.def("clamped_swiglu", &tmk::clamped_swiglu, "gpt-oss's (up + 1) * gate * sigmoid(alpha gate), clamped");
  m.def("decode_attention", &tmk::decode_attention, "one new token per sequence over a paged KV cache");
  m.def("prefill_attention", &tmk::prefill_attention, "prompts' new tokens over a paged KV cache (flash style)");
  m.def("kv_write", &tmk::kv_write, "new keys and values into their cache slots");
  m.def("lora_add", &tmk::lora_add, "every row's LoRA update beside a projection's output");
  m.def("set_bf16_dot", [](int64_t mode) { return std::exchange(tmk::bf16_dot, (int)mode); },
        "bf16 x bf16 pair tiles: -1 where the CPU has vdpbf16ps, 0 never, 1 always (tests); returns the old mode");
  m.def("bf16_dot_native", &tmk::bf16_dot_native, "this build multiplies bf16 pairs with vdpbf16ps");
  m.def("amx_native", &tmk::amx_native, "this build and CPU multiply bf16 pairs and int8 blocks in AMX tiles (and may: Linux)");
  m.def("set_amx", [](int64_t mode) { return std::exchange(tmk::amx_mode, (int)mode); },
        "AMX tiles for bf16 and the quantized formats: -1 from amx_min_rows where the CPU has them, 0 never, 1 from one row (tests)");
  m.def("set_blocked_rows", [](int64_t rows) { return std::exchange(tmk::blocked_rows, rows); },
        "rows from which every linear takes the cache-blocked GEMM (0: each format's default); returns the old one");
  m.def("set_half_width", [](bool on) { return std::exchange(tmk::amd_half_width_512, on); },
        "1-3 rows in the ymm quantized tiles as on a Zen 4 (tests force either path); returns the old setting");
  m.def("set_kspans", [](bool on) { return std::exchange(tmk::kspans, on); },
        "register tiles over K spans where a panel takes several (tests, A/B); returns the old setting");
  m.def("read_sum", &tmk::read_sum, "stream a buffer once (the bandwidth probe)");
  m.def("peak_kinds", &tmk::peak_kinds, "the arithmetic peaks this build and CPU can probe: (kind, instruction, unit)");
  m.def("peak_probe", &tmk::peak_probe, "rounds of one instruction's chains on every thread: (operations, checksum)",
        nogil());
  m.def(
      "contention_rests",
      [](const std::vector<std::pair<double, double>>& programs) {
        tmk::Contention c;
        std::vector<bool> rests;
        for (const auto& [wall, cpu] : programs) rests.push_back(c.starved_again(wall, cpu));
        return rests;
      },
      "the decode pool's verdict after each of these programs (wall, caller CPU seconds): rest the helpers (tests)");
  m.def("pool_selftest", &tmk::pool_selftest, "a decode pool program whose chunk throws, then its sums (tests)",
        nogil());
  m.def("argmax_rows", &tmk::argmax_rows, "each row's argmax (the first maximum, or the first NaN), as torch");
  m.def("apply_bitmask", &tmk::apply_bitmask, "logits whose grammar bit is clear -> -inf, in place");
  m.def("draw_lists", &tmk::draw_lists, "each row's token: temperature, top-k, top-p, min-p, a draw at u", nogil());
  m.def("logprobs_lists", &tmk::logprobs_lists, "rows' logprobs at a token and at their most likely ones", nogil());
  tmk::bind_decode_stack(m);
  m.attr("lanes") = tmk::W;
  m.attr("panel") = tmk::P;
  m.attr("peak_chains") = tmk::kChains;  // accumulators a thread's vector peak chains run (ops/peak.h)
  m.attr("attention_split") = tmk::kSplit;  // positions per split of decode attention (attention/common.h)
}
