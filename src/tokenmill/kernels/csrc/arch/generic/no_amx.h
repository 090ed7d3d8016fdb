// Builds without AMX tiles: amx_native() is false, so linear_range never calls these (they exist so that the format
// table names the same kernels in every build). linear/amx.h picks this file.
#pragma once

#include <cstdint>

#include "linear/format.h"

namespace tmk {

inline bool amx_native() { return false; }

inline void linear_amx(const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*,
                       uint16_t*, int64_t, int64_t) {}

template <Format F>
void linear_amx_k(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*, uint16_t*,
                  int64_t, int64_t) {}

// prefill attention's (arch/amx/amx_attention.h)
inline void amx_configure_attention() {}
inline void amx_release_attention() {}
inline void amx_attention_scores(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t) {}
inline void amx_attention_values(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t,
                                 float*) {}
inline float amx_softmax_row(const float*, int64_t, int64_t, int64_t, float, float&, float&, uint16_t*, uint16_t*) {
  return 1.f;
}
inline void amx_pair_values(const uint16_t* const*, int64_t, int64_t, uint16_t*) {}

template <Format F>
void linear_amx_q(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, const float*, float*, uint16_t*,
                  int64_t, int64_t) {}

}  // namespace tmk
