// The K family's register tile in portable C++ (the scalar variant): the same exact integer sums as the x86 tiles,
// in plain loops, and the same scaling (linear/kformat.h). linear/kquant.h picks this file.
#pragma once

#include <algorithm>
#include <cstdint>

#include "linear/format.h"
#include "linear/kformat.h"
#include "linear/qrow.h"

namespace tmk {

// rows per tile
template <Format>
constexpr int kmt() {
  return 3;
}

// The K-quants' tile (linear/kformat.h): per superblock T = sum of sc (isum - zero sx) in integers, Mn = sum of
// mn sx, then sums += dx (d T - dmin Mn)
template <Format F, int MT>
inline void ktile_super(const uint8_t* panel, const QRow* x, int64_t s0, int64_t s1, float (*sums)[P]) {
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;
  for (int64_t sb = s0; sb < s1; ++sb) {
    const KHeader<F> h{panel + sb * ksb_bytes(S)};
    for (int m = 0; m < MT; ++m) {
      int32_t T[P] = {};
      float Mn[P] = {};
      for (int j = 0; j < S.sb / QK; ++j) {
        const int64_t b = sb * (S.sb / QK) + j;
        for (int s = 0; s < NS; ++s) {
          const int32_t sx = NS == 1 ? x[m].s[2 * b] + x[m].s[2 * b + 1] : x[m].s[2 * b + s];
          for (int c = 0; c < P; ++c) {
            int32_t isum = 0;
            for (int kk = s * S.sub; kk < (s + 1) * S.sub; ++kk)
              isum += kvalue<F>(h.block(j), c, kk) * x[m].q[b * QK + kk];
            T[c] += h.sc(j * NS + s)[c] * (isum - S.zero * sx);
            if constexpr (S.has_min) Mn[c] += (float)h.mn(j * NS + s)[c] * (float)sx;
          }
        }
      }
      const float dx = x[m].d[sb * (S.sb / QK)];
      for (int c = 0; c < P; ++c) {
        float t = (float)T[c] * half_to_float(h.d()[c]);
        if constexpr (S.has_min) t -= half_to_float(h.dmin()[c]) * Mn[c];
        sums[m][c] += t * dx;
      }
    }
  }
}

// MT rows x the panel's 16 channels over superblocks [s0, s1): sums from zero at s0 = 0, else on from `sums`
template <Format F, int MT>
inline void ktile(const uint8_t* panel, const QRow* x, int64_t s0, int64_t s1, float (*sums)[P], bool,
                  const uint8_t*) {  // the x86 tiles' decoded span: never given here
  constexpr KSpec S = kspec(F);
  constexpr int NS = QK / S.sub;  // sub-blocks per block of 32
  if (s0 == 0)
    for (int m = 0; m < MT; ++m) std::fill(sums[m], sums[m] + P, 0.f);
  if constexpr (ksuper(F)) return ktile_super<F, MT>(panel, x, s0, s1, sums);
  for (int64_t sb = s0; sb < s1; ++sb) {
    const KHeader<F> h{panel + sb * ksb_bytes(S)};
    for (int j = 0; j < S.sb / QK; ++j) {
      const int64_t b = sb * (S.sb / QK) + j;
      const uint8_t* blk = h.block(j);
      for (int s = 0; s < NS; ++s) {
        float scale[P], mins[P];
        for (int c = 0; c < P; ++c) scale[c] = h.scale(j * NS + s, c), mins[c] = h.min(j * NS + s, c);
        for (int m = 0; m < MT; ++m) {
          int32_t isum[P] = {};
          for (int kk = s * S.sub; kk < (s + 1) * S.sub; ++kk) {
            const int32_t xq = x[m].q[b * QK + kk];
            for (int c = 0; c < P; ++c) isum[c] += kvalue<F>(blk, c, kk) * xq;
          }
          const int32_t sx = NS == 1 ? x[m].s[2 * b] + x[m].s[2 * b + 1] : x[m].s[2 * b + s];
          for (int c = 0; c < P; ++c) {
            float t = (float)(isum[c] - S.zero * sx) * scale[c];
            if constexpr (S.has_min) t -= mins[c] * (float)sx;
            sums[m][c] += t * x[m].d[b];
          }
        }
      }
    }
  }
}

}  // namespace tmk
