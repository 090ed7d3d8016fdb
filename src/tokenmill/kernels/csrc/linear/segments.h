// A linear as the decode stack holds it (stack/stack.h): one packed weight, or a fused projection whose output rows
// come in up to three segments of different quantized formats (a Q4_K_M GGUF's qkv: q and k in Q4_K, v in Q6_K),
// each segment a whole number of panels but the last. The rows are readied once for all of them: every quantized
// format reads the same QRow blocks (Q8_0's unsigned copy included where a segment needs it).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "linear/format.h"
#include "linear/linear.h"

namespace tmk {

// {weight, format, N outputs, K packed inputs, float32 bias or 0, then for segments 1 and 2: weight (0: none),
// format, first output row}
using LinearSpec = std::array<int64_t, 11>;

struct Segment {
  int64_t weight, format, n0;
};

inline Segment segment(const LinearSpec& w, int s) {
  return s == 0 ? Segment{w[0], w[1], 0} : Segment{w[2 + 3 * s], w[3 + 3 * s], w[4 + 3 * s]};
}

// how the rows are readied for all segments (prep_row): as the first segment's format asks, with Q8_0's unsigned
// copy where a segment is Q8_0, and one scale per superblock where a segment is a K-quant (the other formats read a
// scale per block of 32 and take any group)
inline RowPrep row_prep(const LinearSpec& w) {
  RowPrep how = row_prep((Format)w[1]);
  for (int s = 1; s < 3; ++s) {
    if (!segment(w, s).weight) break;
    const RowPrep other = row_prep((Format)segment(w, s).format);
    how.unsigned_copy |= other.unsigned_copy, how.group = std::max(how.group, other.group);
  }
  return how;
}

// output panels [p_begin, p_end) of linear `w` (linear_range's arguments otherwise): each segment's share, its
// weight addressed so that panel p of the whole is its panel p - (its first panel)
inline void linear_spec_range(const LinearSpec& w, const float* x, int64_t M, int64_t ldx, float* o32, uint16_t* o16,
                              int64_t p_begin, int64_t p_end, const uint16_t* xh, int64_t ldxh,
                              bool pair_major = false) {
  const int64_t N = w[2], K = w[3];
  for (int s = 0; s < 3; ++s) {
    const Segment seg = segment(w, s);
    if (s > 0 && !seg.weight) break;
    const bool last = s == 2 || !segment(w, s + 1).weight;
    const int64_t p0 = seg.n0 / P, p1 = last ? (N + P - 1) / P : segment(w, s + 1).n0 / P;
    const int64_t lo = std::max(p_begin, p0), hi = std::min(p_end, p1);
    if (lo >= hi) continue;
    const Format F = (Format)seg.format;
    const uint8_t* base = (const uint8_t*)(uintptr_t)(seg.weight - p0 * panel_bytes(F, K));
    linear_range(F, x, M, ldx, base, N, K, (const float*)w[4], o32, o16, lo, hi, xh, ldxh, pair_major);
  }
}

}  // namespace tmk
