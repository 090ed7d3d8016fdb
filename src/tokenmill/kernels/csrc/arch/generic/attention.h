// Builds without vdpbf16ps: decode attention takes its portable path (the false return folds away), and prefill's
// key panels AVX2's transpose (arch/avx2/attention.h) where the build has it, else theirs. attention/decode.h picks
// this file.
#pragma once

#include <cstdint>

#include "arch/isa.h"
#if TM_SIMD_AVX2
#include "arch/avx2/attention.h"
#endif

namespace tmk {

template <typename E>
inline bool attention_split_bf16(const uint16_t*, const E*, int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*,
                                 const uint16_t* = nullptr) {
  return false;
}

#if !TM_SIMD_AVX2
inline bool pack_keys_bf16(const uint16_t* const*, int64_t, int64_t, uint32_t*) { return false; }
#endif

}  // namespace tmk
