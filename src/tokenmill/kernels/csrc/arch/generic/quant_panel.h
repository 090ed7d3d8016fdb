// A panel of a quantized weight times mc rows where the build has no tiles of its own for it: qpanel's tiles of
// MT_Q rows over spans of K (the scalar, avx2 and avx512 variants). linear/quant.h picks this file.
#pragma once

#include <cstdint>

#include "linear/format.h"
#include "linear/qpanel.h"
#include "linear/qrow.h"

namespace tmk {

template <Format F>
inline void quant_panel(const uint8_t* panel, const QRow* x, int64_t nb, float (*sums)[P], int64_t mc) {
  qpanel<F>(panel, x, nb, sums, mc);
}

}  // namespace tmk
