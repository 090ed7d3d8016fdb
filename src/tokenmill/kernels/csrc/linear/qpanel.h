// One panel of a quantized weight times a block of quantized rows, in this build's register tiles (qtile<F, MT>:
// arch/avx2/qtile.h on x86, arch/generic/qtile.h elsewhere).
#pragma once

#include <algorithm>
#include <cstdint>

#include "arch/isa.h"
#include "linear/common.h"
#include "linear/format.h"
#include "linear/qrow.h"

#if TM_INT8_YMM
#include "arch/avx2/qtile.h"
#else
#include "arch/generic/qtile.h"
#endif

namespace tmk {

// rows per register tile: with 16 vector registers 4 rows spill the accumulators; AVX-512's 32 hold more, and more
// rows per weight load win there (6 rows fall between)
constexpr int MT_Q = TM_REGS32 ? 8 : 3;

// `rows` <= MT rows in the tile of exactly that many
template <Format F, int MT>
inline void qtile_rows(const uint8_t* panel, const QRow* x, int64_t nb, float (*sums)[P], int64_t rows) {
  with_rows<MT>(rows, [&](auto r) { qtile<F, decltype(r)::value>(panel, x, 0, nb, sums, true); });
}

// A panel times mc rows in register tiles (the builds without tiles of their own: arch/generic/quant_panel.h).
//
// The tiles of MT_Q rows (3; 8 in the avx512 build) run span by span of K (~8 KB of the panel), as the bf16 tiles
// do (linear/dense.h: panel_spans): every tile runs over a span before the next span starts, so its weights come from
// memory once, for the first tile (which alone prefetches), and stay in L1 for the later tiles. Their float sums
// wait in `sums` between spans, one block after another as in one pass: the same bits. Tried and not kept (slower):
// the tiles sharing the next span's prefetch, and spans for the avxvnni build's wide tiles.
template <Format F>
inline void qpanel(const uint8_t* panel, const QRow* x, int64_t nb, float (*sums)[P], int64_t mc) {
  const int64_t tiles = (mc + MT_Q - 1) / MT_Q, bb = quant_block_bytes(F);
  const int64_t span = kspans && tiles > 1 ? std::min(nb, std::max<int64_t>(1, SPAN_BYTES / bb)) : nb;
  for (int64_t b0 = 0; b0 < nb; b0 += span) {
    const int64_t b1 = std::min(nb, b0 + span);
    for (int64_t m = 0; m < mc; m += MT_Q) {
      // in one pass every tile prefetches as it goes; in spans the first (the others find the span in L1)
      with_rows<MT_Q>(std::min<int64_t>(MT_Q, mc - m), [&](auto r) {
        qtile<F, decltype(r)::value>(panel, x + m, b0, b1, sums + m, span == nb || m == 0);
      });
    }
  }
}

}  // namespace tmk
