// The format table: from a weight format to the kernels that multiply it (as ggml-cpu's type_traits_cpu maps a
// ggml type to its vec_dot and from_float). linear_range (linear/linear.h) looks a format up once per call and
// runs the first kernel of its row that takes the call:
//   amx      AMX tiles, from amx_min_rows rows where the CPU has them (amx_pairs: they read the rows as bf16)
//   blocked  the cache-blocked GEMM, from blocked_min_rows() rows (not where the pair tiles run)
//   tiles    the register tiles, for every other row count
// and prep_row readies the activation rows as the row says (quantized to QRow, with the unsigned copy, or float32).
// A new format is a row here (its index its Format id, formats.py's FORMATS), its layout in linear/format.h, and
// its kernels.
#pragma once

#include <cstdint>

#include "linear/amx.h"
#include "linear/blocked.h"
#include "linear/dense.h"
#include "linear/format.h"
#include "linear/kquant.h"
#include "linear/quant.h"
#include "linear/unpack.h"

namespace tmk {

// One call's operands: output panels of out[M, N] = x[M, K] @ w^T (+ bias), out in float32 (o32) or bf16 (o16)
struct LinearArgs {
  const float* x;  // the rows as prep_row readied them, ldx floats apart
  int64_t M, ldx;
  const uint8_t* w;  // the packed weight
  int64_t N, K;
  const float* bias;
  float* o32;
  uint16_t* o16;
  const uint16_t* xh;  // the rows as the model's bf16 (ldxh apart) where the bf16 pair tiles take them, else null
  int64_t ldxh;
  bool pair_major;  // xh holds them pair-major (linear/pair_rows.h)
};
using LinearKernel = void (*)(const LinearArgs& a, int64_t p_begin, int64_t p_end);

struct FormatKernels {
  Format format;
  const char* name;           // formats.py's
  bool quantized_rows;        // the rows are quantized to QRow blocks (linear/qrow.h) for the integer tiles
  bool unsigned_rows;         // ... with their unsigned copy u = q + 128 (vpdpbusd's for a signed weight)
  bool bf16_pairs;            // the tiles read bf16 rows in k pairs where given them (xh)
  LinearKernel tiles;         // the register tiles: every call the others do not take
  LinearKernel blocked;       // the cache-blocked GEMM, or null
  LinearKernel amx;           // the AMX tiles, or null
  bool amx_pairs;             // ... which read the rows as bf16 (xh)
  int64_t amx_min_rows;       // rows from which they take a call
  void (*unpack)(const uint8_t* panel, int64_t K, int64_t n_valid, float* out);
};

// the kernels' own signatures, from one call's operands
inline void run_dense_bf16(const LinearArgs& a, int64_t p0, int64_t p1) {
  linear_panels<uint16_t>(a.x, a.M, a.ldx, a.w, a.N, a.K, a.bias, a.o32, a.o16, p0, p1, a.xh, a.ldxh, a.pair_major);
}
inline void run_dense_f32(const LinearArgs& a, int64_t p0, int64_t p1) {
  linear_panels<float>(a.x, a.M, a.ldx, a.w, a.N, a.K, a.bias, a.o32, a.o16, p0, p1, nullptr, 0, false);
}
template <Format F>
void run_blocked(const LinearArgs& a, int64_t p0, int64_t p1) {
  linear_blocked<F>(a.x, a.M, a.ldx, a.w, a.N, a.K, a.bias, a.o32, a.o16, p0, p1);
}
template <Format F>
void run_kquant(const LinearArgs& a, int64_t p0, int64_t p1) {
  linear_kquant<F>(a.x, a.M, a.ldx, a.w, a.N, a.K, a.bias, a.o32, a.o16, p0, p1);
}
template <Format F>
void run_quant(const LinearArgs& a, int64_t p0, int64_t p1) {
  linear_quant<F>(a.x, a.M, a.ldx, a.w, a.N, a.K, a.bias, a.o32, a.o16, p0, p1);
}
inline void run_amx_bf16(const LinearArgs& a, int64_t p0, int64_t p1) {
  linear_amx(a.xh, a.M, a.ldxh, a.w, a.N, a.K, a.bias, a.o32, a.o16, p0, p1);
}
template <Format F>
void run_amx_quant(const LinearArgs& a, int64_t p0, int64_t p1) {
  linear_amx_q<F>(a.x, a.M, a.ldx, a.w, a.N, a.K, a.bias, a.o32, a.o16, p0, p1);
}

template <Format F>
void run_amx_kquant(const LinearArgs& a, int64_t p0, int64_t p1) {
  linear_amx_k<F>(a.x, a.M, a.ldx, a.w, a.N, a.K, a.bias, a.o32, a.o16, p0, p1);
}

// The table. amx_min_rows: rows from which the AMX tiles take a weight's products; below, vdpbf16ps or vpdpbusd
// tiles do (Q4_0 unpacks each block for the tiles, so it needs more rows to gain).
// `static`, not `inline`: GCC makes an inline variable one object per process (STB_GNU_UNIQUE), so a process that
// loads two variants (the tests do) would run the first one's kernels from the second.
static constexpr FormatKernels kFormatKernels[] = {
    // format, name, quantized_rows, unsigned_rows, bf16_pairs, tiles, blocked, amx, amx_pairs, amx_min_rows, unpack
    {BF16, "bf16", false, false, true, run_dense_bf16, run_blocked<BF16>, run_amx_bf16, true, 4, unpack_panel<BF16>},
    {Q8_0, "q8_0", true, true, false, run_quant<Q8_0>, nullptr, run_amx_quant<Q8_0>, false, 5, unpack_panel<Q8_0>},
    {Q4_0, "q4_0", true, false, false, run_quant<Q4_0>, nullptr, run_amx_quant<Q4_0>, false, 9, unpack_panel<Q4_0>},
    {F32, "f32", false, false, false, run_dense_f32, run_blocked<F32>, nullptr, false, 0, unpack_panel<F32>},
    // the K family (linear/kformat.h), IQ4 included: AMX unpacks each block for the tiles, as for Q4_0
    {Q4_K, "q4_k", true, false, false, run_kquant<Q4_K>, nullptr, run_amx_kquant<Q4_K>, false, 9, unpack_panel<Q4_K>},
    {Q5_K, "q5_k", true, false, false, run_kquant<Q5_K>, nullptr, run_amx_kquant<Q5_K>, false, 9, unpack_panel<Q5_K>},
    {Q6_K, "q6_k", true, false, false, run_kquant<Q6_K>, nullptr, run_amx_kquant<Q6_K>, false, 9, unpack_panel<Q6_K>},
    {Q5_0, "q5_0", true, false, false, run_kquant<Q5_0>, nullptr, run_amx_kquant<Q5_0>, false, 9, unpack_panel<Q5_0>},
    {Q5_1, "q5_1", true, false, false, run_kquant<Q5_1>, nullptr, run_amx_kquant<Q5_1>, false, 9, unpack_panel<Q5_1>},
    {Q4_1, "q4_1", true, false, false, run_kquant<Q4_1>, nullptr, run_amx_kquant<Q4_1>, false, 9, unpack_panel<Q4_1>},
    {IQ4_NL, "iq4_nl", true, false, false, run_kquant<IQ4_NL>, nullptr, run_amx_kquant<IQ4_NL>, false, 9,
     unpack_panel<IQ4_NL>},
    {IQ4_XS, "iq4_xs", true, false, false, run_kquant<IQ4_XS>, nullptr, run_amx_kquant<IQ4_XS>, false, 9,
     unpack_panel<IQ4_XS>},
    {MXFP4, "mxfp4", true, false, false, run_kquant<MXFP4>, nullptr, run_amx_kquant<MXFP4>, false, 9,
     unpack_panel<MXFP4>},
};
constexpr bool table_in_order() {
  for (int f = 0; f < (int)(sizeof(kFormatKernels) / sizeof(kFormatKernels[0])); ++f)
    if (kFormatKernels[f].format != f) return false;
  return true;
}
static_assert(table_in_order(), "the table's rows in Format order");

inline const FormatKernels& format_kernels(Format F) { return kFormatKernels[F]; }

}  // namespace tmk
