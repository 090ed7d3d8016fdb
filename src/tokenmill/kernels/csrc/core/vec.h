// The kernels' vector types: TM_W float lanes as GCC/Clang vector extensions, and the weight panels' width.
//
// One source serves every ISA: the build compiles it with TM_W=4 and no ISA flags (the portable "scalar" variant:
// SSE2 on x86-64, NEON on arm64), TM_W=8 with AVX2 flags, and TM_W=16 with AVX-512 flags. Arithmetic is plain
// vector code (`acc += a * b` becomes vfmadd under -ffp-contract=fast).
#pragma once

#include <cstdint>
#include <type_traits>

#include "arch/isa.h"

namespace tmk {

constexpr int W = TM_W;  // float lanes per vector
constexpr int P = 16;    // output channels per weight panel (every packed format); W divides P
constexpr int V = P / W; // vectors per panel row
static_assert(P % W == 0, "the lane count must divide the panel width");

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vu16 __attribute__((vector_size(W * 2)));

// fn(std::integral_constant<int, rows>{}) for LO <= rows <= MT: a register tile's row count must be a template
// argument, so the remainder of M is dispatched to the tile of exactly that many rows.
template <int MT, int LO = 1, typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (MT > LO) {
    if (rows < MT) return with_rows<MT - 1, LO>(rows, fn);
  }
  fn(std::integral_constant<int, MT>{});
}

}  // namespace tmk
