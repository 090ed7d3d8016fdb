// One product instruction with a row's activations as its embedded-broadcast memory operand ({1to16}): the
// intrinsics of a broadcast take a vpbroadcastd of their own per row (GCC never folds it into vdpbf16ps or
// vpdpbusd), which doubled the instructions a tile puts through the front end (Zen 4: arch/avx512bf16/pair_tile.h,
// ktile512.h, qtile512.h; docs/benchmarks.md).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "arch/isa.h"

#if !TM_BF16_PAIRS && !TM_Q512
#error "arch/avx512bf16/dp_broadcast.h is for 16-lane builds with AVX-512 BF16 or VNNI"
#endif

namespace tmk {

#if TM_BF16_PAIRS

// acc += w . (the bf16 pair at `pair` + Offset bytes, broadcast): vdpbf16ps. An asm statement per row with its
// accumulator through a temporary (an asm operand naming an array element kept the whole array on the stack).
template <int Offset>
inline __m512 dpbf16_broadcast(__m512 acc, __m512 w, const int32_t* pair) {
  asm("vdpbf16ps %c2(%1)%{1to16%}, %3, %0" : "+v"(acc) : "r"(pair), "i"(Offset), "v"(w));
  return acc;
}
#endif

#if TM_Q512
// acc += w (unsigned bytes) . (the 4 signed bytes at `four`, broadcast): vpdpbusd
inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const void* four) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)four));
  return acc;
}
#endif

}  // namespace tmk
