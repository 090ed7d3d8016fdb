// The linear layer as one operation: out[M, N] = x[M, K] @ w^T (+ bias) for a packed weight of any format, over a
// range of output panels (a thread's chunk), its rows readied once by prep_row. The format's row of the table
// (linear/type_traits.h) says which kernels run; the decode stack (stack/stack.h) and kernels.cpp's linear call
// these.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "linear/amx.h"
#include "linear/blocked.h"
#include "linear/format.h"
#include "linear/pair_rows.h"
#include "linear/pair_tile.h"
#include "linear/qrow.h"
#include "linear/type_traits.h"

namespace tmk {

inline int64_t amx_min_rows(Format F) { return amx_mode > 0 ? 1 : format_kernels(F).amx_min_rows; }
// The AMX tiles take M rows by a weight of format F (a bf16 weight's given the rows as bf16 pairs).
inline bool amx_takes(Format F, int64_t M) {
  return format_kernels(F).amx && use_amx() && M >= amx_min_rows(F);
}
// They take panels two at a time: a thread's chunk of `panels` rounded up to an even count where they run.
inline int64_t amx_even(Format F, int64_t M, int64_t panels) {
  return amx_takes(F, M) ? panels + (panels & 1) : panels;
}

// Output panels [p_begin, p_end) for any format, x rows prepared by prep_row `ldx` floats apart: the quantized
// formats in integers (linear/quant.h), the dense ones in register tiles or, from blocked_min_rows(), the blocked
// GEMM. `xh`: the rows as the model's bfloat16 (row stride ldxh), or null; a bf16 weight's tiles multiply those
// pairs where use_bf16_dot() (AVX-512 BF16), which needs K == the rows' width (even, no padding to read past).
// `pair_major`: xh holds the rows pair-major instead (linear/pair_rows.h), as the caller readies them where
// takes_pair_major() (then ldxh is K and x is not read).
inline void linear_range(Format F, const float* x, int64_t M, int64_t ldx, const uint8_t* w, int64_t N, int64_t K,
                         const float* bias, float* o32, uint16_t* o16, int64_t p_begin, int64_t p_end,
                         const uint16_t* xh = nullptr, int64_t ldxh = 0, bool pair_major = false) {
  const FormatKernels& t = format_kernels(F);
  if (!use_bf16_dot() || ldxh != K) xh = nullptr;
  const LinearArgs a{x, M, ldx, w, N, K, bias, o32, o16, xh, ldxh, pair_major && xh};
  if (a.pair_major) return t.tiles(a, p_begin, p_end);
  if (amx_takes(F, M) && (xh || !t.amx_pairs)) return t.amx(a, p_begin, p_end);
  // the pair tiles beat the blocked GEMM at every M where vdpbf16ps does them (two products per lane and
  // instruction against one FMA), so a weight with pairs never takes it
  if (t.blocked && M >= blocked_min_rows() && !(t.bf16_pairs && xh && bf16_dot_native()))
    return t.blocked(a, p_begin, p_end);
  t.tiles(a, p_begin, p_end);
}

// A bf16 weight's product over bf16 rows Kx wide takes the pair tiles and never reads the rows as float32:
// vdpbf16ps here, the rows not padded (linear_range).
inline bool pairs_apply(Format F, bool bf16, int64_t Kx, int64_t K) {
  return format_kernels(F).bf16_pairs && bf16 && Kx == K && use_bf16_dot() && bf16_dot_native();
}

// The pair tiles, not the AMX ones, take M bf16 rows Kx wide: the caller readies them pair-major
// (linear/pair_rows.h) and tells linear_range so. Also where the pairs are FMAs (use_bf16_dot() forced on: tests).
inline bool takes_pair_major(Format F, bool bf16, int64_t Kx, int64_t K, int64_t M) {
  return format_kernels(F).bf16_pairs && bf16 && Kx == K && use_bf16_dot() && !amx_takes(F, M);
}

// How many output panels one thread's chunk should take: at least ~`bytes` of weight reads (more rows, fewer).
inline int64_t panels_per_chunk(Format F, int64_t K, int64_t M, int64_t bytes) {
  return amx_even(F, M, std::max<int64_t>(1, bytes / (panel_bytes(F, K) * (1 + M / 8))));
}

// How prep_row readies the rows for a format's tiles: quantized to the QRow layout (with the unsigned copy of
// Q8_0's VNNI tiles), one scale per `group` k (linear/qrow.h)
struct RowPrep {
  bool quantized, unsigned_copy;
  int64_t group;
};
inline RowPrep row_prep(Format F) {
  const FormatKernels& t = format_kernels(F);
  return {t.quantized_rows, t.unsigned_rows, row_group(F)};
}

// One activation row (bfloat16 or float32, Kx wide) as the kernels read it, in `dst` (room for K floats): float32,
// zero-padded to K; for the quantized formats, quantized to the QRow layout (linear/qrow.h). Only its values
// [k0, k1) where k1 >= 0 (multiples of the prep's group: the row in parts, by threads).
inline void prep_row(const void* src, bool bf16, int64_t Kx, int64_t K, RowPrep how, float* dst, int64_t k0 = 0,
                     int64_t k1 = -1) {
  thread_local std::vector<float> staged;
  if (k1 < 0) k1 = K;
  float* f = dst;
  if (how.quantized) staged.resize(K), f = staged.data();
  const int64_t kx = std::min(std::max(Kx, k0), k1);  // [k0, kx) from src, [kx, k1) padding
  if (bf16) {
    const uint16_t* s = (const uint16_t*)src;
    for (int64_t k = k0; k < kx; ++k) {
      uint32_t bits = (uint32_t)s[k] << 16;
      std::memcpy(&f[k], &bits, 4);
    }
  } else {
    std::memcpy(f + k0, (const float*)src + k0, (kx - k0) * 4);
  }
  std::fill(f + kx, f + k1, 0.f);
  if (how.quantized) quantize_row(f, K, dst, how.unsigned_copy, k0 / QK, k1 / QK, how.group);
}

}  // namespace tmk
