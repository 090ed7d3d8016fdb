// Builds without vdpbf16ps: decode attention and prefill's key panels take their portable paths (the false
// returns fold away). attention/decode.h picks this file.
#pragma once

#include <cstdint>

namespace tmk {

inline bool attention_split_bf16(const uint16_t*, const uint16_t*, int64_t, const int64_t*, int64_t, int64_t, int64_t,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*) {
  return false;
}

inline bool pack_keys_bf16(const uint16_t* const*, int64_t, int64_t, uint32_t*) { return false; }

}  // namespace tmk
