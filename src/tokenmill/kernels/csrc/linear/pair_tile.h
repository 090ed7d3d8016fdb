// The bf16 pair tile, tile_bf16_pairs<MT, S>(panel, xh, ldxh, K, acc), from this build's arch file, and the switch
// that decides where it runs.
//
// bf16 weights times bf16 activations read as pairs straight from the model's rows (xh, row stride ldxh; K even):
// acc[m][v] += w[2j] x[m][2j] + w[2j + 1] x[m][2j + 1] for every pair j. With AVX-512 BF16 one vdpbf16ps does a
// pair for 16 channels (the panel's k-pair layout is its operand, the activation pair one broadcast word); the
// products are exact in float32 either way, so only the order of the float32 sums differs from tile_dense. Other
// builds compute the same sums with FMAs (arch/generic/pair_tile.h), so that the tests can run this path's
// plumbing on any CPU.
#pragma once

#include "arch/isa.h"

#if TM_BF16_PAIRS
#include "arch/avx512bf16/pair_tile.h"
#else
#include "arch/generic/pair_tile.h"
#endif

namespace tmk {

inline bool bf16_dot_native() { return TM_BF16_PAIRS; }
// -1: pairs where the CPU has vdpbf16ps (the default); 0: never; 1: always (tests)
inline int bf16_dot = -1;
inline bool use_bf16_dot() { return bf16_dot < 0 ? bf16_dot_native() : bf16_dot > 0; }

}  // namespace tmk
