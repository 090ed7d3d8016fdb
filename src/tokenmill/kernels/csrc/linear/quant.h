// Quantized weights (Q8_0, Q4_0) times quantized activations, in integer arithmetic, as ggml does it.
//
// Each activation row is quantized once per call to Q8_0 blocks (32 int8 values and one float scale per block;
// `quantize_row`). A block's dot product with a weight block is then an exact sum of int8 x int8 (or uint4 x
// int8) products, scaled once by d_w * d_x. The multiplies are 8-bit: on AVX2, vpmaddubsw multiplies 32 byte
// pairs and adds neighbours into 16-bit lanes, and vpmaddwd adds those into 32-bit lanes, 4 k at a time, so one
// instruction does the work of four float FMAs. For that the weights are stored in groups of 4 k per channel
// (formats.py):
//   Q8_0 block: { fp16 d[16]; int8  q[8][16][4] }  q[g][c][i] = w[c][4g + i]
//   Q4_0 block: { fp16 d[16]; uint8 q[8][8][4] }   q[g][c][i] = w[c][4g + i] | w[c + 8][4g + i] << 4 (w in 0..15,
//                                                  the weight is d * (w - 8))
// so that one 32-byte load holds 8 channels x 4 k (Q8_0), or 16 channels x 4 k in its two nibbles (Q4_0), and
// the row's 4 bytes at k = 4g.. are broadcast to every channel.
//
// vpmaddubsw multiplies an unsigned byte by a signed one and saturates its 16-bit pair sums. Q4_0's nibbles are
// unsigned (0..15): a pair sums to at most 2 * 15 * 127, so all 8 groups of a block add up in 16 bits (30480
// < 32767) before one vpmaddwd. Q8_0 takes |w| as the unsigned side and moves w's sign onto x (vpsignb), so a
// pair sums to at most 2 * 128 * 127 < 32767; its groups widen to 32 bits one by one. The -8 of Q4_0 is
// subtracted once per block as 8 * (sum of the row's q over the block).
//
// With VNNI (AVX-512 VNNI with VL, or AVX-VNNI), vpdpbusd multiplies the same byte pairs and adds groups of 4
// straight into 32-bit lanes: one instruction for vpmaddubsw + vpmaddwd + vpaddd, and the same exact sums (none
// of them saturates above). Its 32-bit sums cannot saturate at all, so Q8_0 there takes x + 128 as the unsigned
// side and w as it is, and subtracts 128 * (sum of w) per channel and block, as Q4_0 subtracts its 8. The
// portable variant (no AVX2) runs the same integer sums in plain loops: the numbers are the same.
//
// The tiles are per ISA: arch/avx2/qtile.h (ymm, every x86 variant), arch/avxvnni/qwide.h (the avxvnni variant's
// wide tiles), arch/avx512bf16/qtile512.h (zmm, AVX-512 VNNI), arch/generic/qtile.h (portable); each build's
// quant_panel (one panel times a block of rows) comes from one of them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "arch/isa.h"
#include "linear/common.h"
#include "linear/format.h"
#include "linear/qrow.h"

#if TM_Q512
#include "arch/avx512bf16/qtile512.h"
#elif TM_WIDE
#include "arch/avxvnni/qwide.h"
#else
#include "arch/generic/quant_panel.h"
#endif

namespace tmk {

constexpr int64_t QMC = 64;  // rows per block: their quantized x (64 x K bytes) stays in L2 across the panels

// Output panels [p_begin, p_end) of out[M, N] = x[M, K] @ w^T (+ bias), x rows in the QRow layout `ldx` floats
// apart, `stride` bytes a panel: for each block of QMC rows, every panel passes over them in `panel_fn(panel, rows,
// sums, mc)` (a format family's tiles: quant_panel here, kpanel for the K family). A row's blocks are summed in the
// same order whatever M is, so its output does not depend on the batch.
template <typename PanelFn>
void quant_rows(const float* x, int64_t M, int64_t ldx, const uint8_t* packed, int64_t stride, int64_t N, int64_t K,
                const float* bias, float* out32, uint16_t* out16, int64_t p_begin, int64_t p_end, PanelFn panel_fn) {
  const int64_t nb = K / QK;
  QRow rx[QMC];
  float sums[QMC][P];
  for (int64_t m0 = 0; m0 < M; m0 += QMC) {
    const int64_t mc = std::min(QMC, M - m0);
    for (int64_t r = 0; r < mc; ++r) rx[r] = qrow(x + (m0 + r) * ldx, nb);
    for (int64_t p = p_begin; p < p_end; ++p) {
      panel_fn(packed + p * stride, rx, sums, mc);
      const int64_t n0 = p * P, n_valid = std::min<int64_t>(P, N - n0);
      for (int64_t r = 0; r < mc; ++r) store_outputs(sums[r], m0 + r, n0, n_valid, N, bias, out32, out16);
    }
  }
}

// linear_range's Q8_0 / Q4_0 product (quant_rows over this build's quant_panel)
template <Format F>
void linear_quant(const float* x, int64_t M, int64_t ldx, const uint8_t* packed, int64_t N, int64_t K,
                  const float* bias, float* out32, uint16_t* out16, int64_t p_begin, int64_t p_end) {
  const int64_t nb = K / QK;
  quant_rows(x, M, ldx, packed, panel_bytes(F, K), N, K, bias, out32, out16, p_begin, p_end,
             [nb](const uint8_t* panel, const QRow* rx, float (*sums)[P], int64_t mc) {
               quant_panel<F>(panel, rx, nb, sums, mc);
             });
}

}  // namespace tmk
