// The K family (linear/kformat.h) times quantized activation rows, in integer arithmetic: the rows are quantized
// once per call to Q8_0 blocks (linear/qrow.h), as for Q8_0 and Q4_0 weights (linear/quant.h), and each panel
// passes over a block of them in this build's tiles:
//   arch/avx512bf16/ktile512.h  zmm, AVX-512 VNNI (the avx512bf16 variant; 1-3 rows on a Zen 4 take the ymm ones,
//                               core/cpu.h)
//   arch/avx2/ktile.h           ymm, every other x86 variant (vpdpbusd where the build has VNNI)
//   arch/generic/ktile.h        portable loops (the scalar variant)
// Tiles run span by span of K where a panel takes several of them, as qpanel does (linear/qpanel.h): the first
// tile streams the span from memory, the others find it in L1.
#pragma once

#include <algorithm>
#include <cstdint>

#include "arch/isa.h"
#include "linear/common.h"
#include "linear/format.h"
#include "linear/kformat.h"
#include "linear/qrow.h"
#include "linear/quant.h"

#if TM_INT8_YMM
#include "arch/avx2/ktile.h"
#else
#include "arch/generic/ktile.h"
#endif
#if TM_Q512
#include "arch/avx512bf16/ktile512.h"
#endif

namespace tmk {

// A panel times mc rows, in tiles of up to MT rows of `tile`, span by span of superblocks. `decode(s0, s1)` gives
// a span's groups decoded once for all its tiles (or null: each tile decodes them itself), where there are several.
template <Format F, int MT, typename Tile, typename Decode>
inline void kpanel_in(const uint8_t* panel, const QRow* x, int64_t nsb, float (*sums)[P], int64_t mc, Tile tile,
                      Decode decode) {
  const int64_t tiles = (mc + MT - 1) / MT, per = (mc + tiles - 1) / tiles;  // even tiles: 12 rows as 6 + 6
  const int64_t span = kspans && tiles > 1 ? std::min(nsb, std::max<int64_t>(1, SPAN_BYTES / ksb_bytes(kspec(F)))) : nsb;
  for (int64_t s0 = 0; s0 < nsb; s0 += span) {
    const int64_t s1 = std::min(nsb, s0 + span);
    const uint8_t* dec = tiles > 1 ? decode(s0, s1) : nullptr;
    for (int64_t m = 0; m < mc; m += per)
      with_rows<MT>(std::min<int64_t>(per, mc - m), [&](auto r) {
        tile(r, panel, x + m, s0, s1, sums + m, !dec && (span == nsb || m == 0), dec);
      });
  }
}

template <Format F>
inline void kpanel(const uint8_t* panel, const QRow* x, int64_t nsb, float (*sums)[P], int64_t mc) {
  using Sums = float (*)[P];
#if TM_Q512
  if (!(mc < 4 && amd_half_width_512))
    return kpanel_in<F, MT_K512>(
        panel, x, nsb, sums, mc,
        [](auto r, const uint8_t* p, const QRow* rx, int64_t s0, int64_t s1, Sums sm, bool pf, const uint8_t*) {
          ktile512<F, decltype(r)::value>(p, rx, s0, s1, sm, pf);
        },
        [](int64_t, int64_t) -> const uint8_t* { return nullptr; });
#endif
#if TM_INT8_YMM
  const auto decode = [panel](int64_t s0, int64_t s1) { return kdecoded<F>(panel, s0, s1); };
#else
  const auto decode = [](int64_t, int64_t) -> const uint8_t* { return nullptr; };
#endif
  kpanel_in<F, kmt<F>()>(
      panel, x, nsb, sums, mc,
      [](auto r, const uint8_t* p, const QRow* rx, int64_t s0, int64_t s1, Sums sm, bool pf, const uint8_t* dec) {
        ktile<F, decltype(r)::value>(p, rx, s0, s1, sm, pf, dec);
      },
      decode);
}

// linear_range's K-family product: the rows in blocks of QMC, each panel over them in kpanel (linear/quant.h:
// quant_rows)
template <Format F>
void linear_kquant(const float* x, int64_t M, int64_t ldx, const uint8_t* packed, int64_t N, int64_t K,
                   const float* bias, float* out32, uint16_t* out16, int64_t p_begin, int64_t p_end) {
  const int64_t nsb = K / kspec(F).sb;
  quant_rows(x, M, ldx, packed, panel_bytes(F, K), N, K, bias, out32, out16, p_begin, p_end,
             [nsb](const uint8_t* panel, const QRow* rx, float (*sums)[P], int64_t mc) {
               kpanel<F>(panel, rx, nsb, sums, mc);
             });
}

}  // namespace tmk
