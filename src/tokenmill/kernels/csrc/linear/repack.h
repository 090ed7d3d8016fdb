// A GGUF tensor's ggml blocks -> the kernels' panels, in one pass from the file's map (kernels.cpp's repack_gguf):
// each block's numbers are read as ggml lays them out and written where the panel layout wants them
// (linear/format.h, linear/kformat.h). Nothing is re-quantized, so the result is byte for byte what
// kernels/formats.py and kernels/kformats.py pack from the same numbers (their tests compare the two).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "linear/format.h"
#include "linear/kformat.h"

namespace tmk {

// one ggml block's numbers: q[0..sb) (0 .. 2^bits - 1; Q8_0's as int8 bits; IQ4's table indices), d and dmin (fp16
// bits), sc and mn
struct GgmlBlock {
  uint8_t q[256];
  uint16_t d, dmin;
  int8_t sc[16];
  uint8_t mn[16];
};

// bytes of one ggml block of format F, and the k it covers
inline int64_t ggml_block_bytes(Format F) {
  switch (F) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q4_1: return 20;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    case MXFP4: return 17;
    default: return 0;
  }
}
inline int64_t ggml_block_k(Format F) { return is_kfamily(F) ? kspec(F).sb : QK; }

inline uint16_t u16_at(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// the K-quants' 12 scale bytes -> 6-bit sc, mn of sub-block j (ggml's get_scale_min_k4)
inline void scale_min_k4(const uint8_t* s, int j, int8_t& sc, uint8_t& mn) {
  if (j < 4) sc = (int8_t)(s[j] & 63), mn = s[j + 4] & 63;
  else sc = (int8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)), mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}

// IQ4_XS {d, uint16 scales_h, scales_l[4], qs[128]}: sub-block j's 6-bit scale is scales_l's nibble j (low first)
// and bits 2j, 2j + 1 of scales_h, less 32; its 32 q are qs[16 j ..] as Q4_0's block (low nibbles, then high)
inline void read_iq4_xs(const uint8_t* b, GgmlBlock& o) {
  o.d = u16_at(b);
  const uint16_t high = u16_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    o.sc[j] = (int8_t)((((b[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4)) - 32);
    const uint8_t* qs = b + 8 + 16 * j;
    for (int l = 0; l < 16; ++l) o.q[32 * j + l] = qs[l] & 15, o.q[32 * j + 16 + l] = qs[l] >> 4;
  }
}

// MXFP4's e8m0 exponent e -> d = 2^(e - 128) as fp16 bits, exactly: normal for e in [114, 143], subnormal in
// [104, 113]; e outside holds no fp16 (kernels/kformats.py refuses such a tensor before it gets here)
inline uint16_t mxfp4_scale(uint8_t e) {
  const int x = (int)e - 128;
  if (x < -24 || x > 15) throw std::invalid_argument("an MXFP4 block's scale 2^" + std::to_string(x) + " is no fp16");
  return x >= -14 ? (uint16_t)((x + 15) << 10) : (uint16_t)(1u << (x + 24));
}

template <Format F>
inline void read_ggml_block(const uint8_t* b, GgmlBlock& o) {
  if constexpr (F == MXFP4) {  // {e, qs[16]}: qs as IQ4_NL's
    o.d = mxfp4_scale(b[0]);
    for (int j = 0; j < 16; ++j) o.q[j] = b[1 + j] & 15, o.q[j + 16] = b[1 + j] >> 4;
  } else if constexpr (F == Q8_0 || F == Q4_0 || F == IQ4_NL) {  // {d, qs}: IQ4_NL's as Q4_0's
    o.d = u16_at(b);
    for (int j = 0; j < 16; ++j) {
      if constexpr (F == Q8_0) o.q[j] = b[2 + j], o.q[j + 16] = b[18 + j];
      else o.q[j] = b[2 + j] & 15, o.q[j + 16] = b[2 + j] >> 4;
    }
  } else if constexpr (F == IQ4_XS) {
    read_iq4_xs(b, o);
  } else if constexpr (F == Q4_K || F == Q5_K) {
    o.d = u16_at(b), o.dmin = u16_at(b + 2);
    for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, o.sc[j], o.mn[j]);
    const uint8_t *qh = b + 16, *qs = b + (F == Q5_K ? 48 : 16);
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 32; ++l) {
        uint8_t lo = qs[32 * p + l] & 15, hi = qs[32 * p + l] >> 4;
        if constexpr (F == Q5_K) lo |= ((qh[l] >> (2 * p)) & 1) << 4, hi |= ((qh[l] >> (2 * p + 1)) & 1) << 4;
        o.q[64 * p + l] = lo, o.q[64 * p + 32 + l] = hi;
      }
  } else if constexpr (F == Q6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    std::memcpy(o.sc, b + 192, 16);
    o.d = u16_at(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t a = ql[64 * h + l], c = ql[64 * h + 32 + l], e = qh[32 * h + l];
        o.q[128 * h + l] = (a & 15) | ((e & 3) << 4);
        o.q[128 * h + 32 + l] = (c & 15) | (((e >> 2) & 3) << 4);
        o.q[128 * h + 64 + l] = (a >> 4) | (((e >> 4) & 3) << 4);
        o.q[128 * h + 96 + l] = (c >> 4) | (((e >> 6) & 3) << 4);
      }
  } else {  // Q5_0 {d, qh, qs}, Q5_1 {d, m, qh, qs}, Q4_1 {d, m, qs}: our dmin is -m (w = d q - dmin)
    o.d = u16_at(b);
    int at = 2;
    if constexpr (F != Q5_0) o.dmin = u16_at(b + 2) ^ 0x8000, at = 4;
    uint32_t qh = 0;
    if constexpr (F != Q4_1) std::memcpy(&qh, b + at, 4), at += 4;
    for (int j = 0; j < 16; ++j) {
      o.q[j] = (b[at + j] & 15) | (((qh >> j) & 1) << 4);
      o.q[j + 16] = (b[at + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
  }
}

// channel c's block (numbers `g`) -> its place in a panel's block at `dst` (superblock or Q8_0/Q4_0 block)
template <Format F>
inline void write_kblock(const GgmlBlock& g, int c, uint8_t* dst);

template <Format F>
inline void write_panel_block(const GgmlBlock& g, int c, uint8_t* dst) {
  if constexpr (F == Q8_0 || F == Q4_0) {
    std::memcpy(dst + 2 * c, &g.d, 2);
    uint8_t* q = dst + 2 * P;
    for (int kk = 0; kk < QK; ++kk) {
      const int gi = kk / 4, i = kk % 4;
      if constexpr (F == Q8_0) q[gi * 64 + c * 4 + i] = g.q[kk];
      else q[gi * 32 + (c % 8) * 4 + i] |= c < 8 ? g.q[kk] : g.q[kk] << 4;
    }
  } else {
    write_kblock<F>(g, c, dst);
  }
}

// write_panel_block's K family: the header's numbers, then each block's nibbles and high bits
template <Format F>
inline void write_kblock(const GgmlBlock& g, int c, uint8_t* dst) {
  constexpr KSpec S = kspec(F);
  constexpr int subs = S.sb / S.sub;
  std::memcpy(dst + 2 * c, &g.d, 2);
  if (S.has_min) std::memcpy(dst + 2 * P + 2 * c, &g.dmin, 2);
  if constexpr (subs > 1)
    for (int s = 0; s < subs; ++s) {
      dst[2 * P * (1 + S.has_min) + s * P + c] = (uint8_t)g.sc[s];
      if (S.has_min) dst[2 * P * (1 + S.has_min) + (subs + s) * P + c] = g.mn[s];
    }
  const int64_t hb = kheader_bytes(S), bb = kblock_bytes(S);
  for (int j = 0; j < S.sb / QK; ++j) {
    uint8_t* blk = dst + hb + j * bb;
    const uint8_t* q = g.q + j * QK;
    for (int gi = 0; gi < QK / 4; ++gi) {
      uint8_t* nib = blk + gi * 32 + (c % 8) * 4;
      for (int i = 0; i < 4; ++i) nib[i] |= c < 8 ? (q[4 * gi + i] & 15) : (q[4 * gi + i] & 15) << 4;
      if constexpr (S.planes > 0) {  // the bits above the low 4, where linear/kformat.h's kvalue reads them
        uint8_t* high = khigh_group<S.planes>(blk, gi);
        for (int i = 0, j = 4 * c; i < 4; ++i, ++j)
          high[khigh_byte<S.planes>(j)] |= (uint8_t)((q[4 * gi + i] >> 4) << khigh_shift<S.planes>(j));
      }
    }
  }
}

// panels [p0, p1) of an [N, K] weight whose rows of ggml blocks lie at src (row_bytes apart) -> dst (the packed
// weight, panel_bytes(F, K) a panel; zeroed here first: rows past N stay zero)
template <Format F>
void repack_panels_t(const uint8_t* src, int64_t row_bytes, int64_t N, int64_t K, uint8_t* dst, int64_t p0, int64_t p1) {
  const int64_t stride = panel_bytes(F, K), bk = ggml_block_k(F), bytes = ggml_block_bytes(F);
  const int64_t out_block = kLayouts[F].block_bytes;  // a panel's block (Q8_0/Q4_0) or superblock
  GgmlBlock g{};
  for (int64_t p = p0; p < p1; ++p) {
    uint8_t* panel = dst + p * stride;
    std::memset(panel, 0, stride);
    for (int c = 0; c < P && p * P + c < N; ++c) {
      const uint8_t* row = src + (p * P + c) * row_bytes;
      for (int64_t b = 0; b < K / bk; ++b) {
        read_ggml_block<F>(row + b * bytes, g);
        write_panel_block<F>(g, c, panel + b * out_block);
      }
    }
  }
}

inline void repack_panels(Format F, const uint8_t* src, int64_t row_bytes, int64_t N, int64_t K, uint8_t* dst,
                          int64_t p0, int64_t p1) {
  switch (F) {
    case Q8_0: return repack_panels_t<Q8_0>(src, row_bytes, N, K, dst, p0, p1);
    case Q4_0: return repack_panels_t<Q4_0>(src, row_bytes, N, K, dst, p0, p1);
    case Q4_K: return repack_panels_t<Q4_K>(src, row_bytes, N, K, dst, p0, p1);
    case Q5_K: return repack_panels_t<Q5_K>(src, row_bytes, N, K, dst, p0, p1);
    case Q6_K: return repack_panels_t<Q6_K>(src, row_bytes, N, K, dst, p0, p1);
    case Q5_0: return repack_panels_t<Q5_0>(src, row_bytes, N, K, dst, p0, p1);
    case Q5_1: return repack_panels_t<Q5_1>(src, row_bytes, N, K, dst, p0, p1);
    case Q4_1: return repack_panels_t<Q4_1>(src, row_bytes, N, K, dst, p0, p1);
    case IQ4_NL: return repack_panels_t<IQ4_NL>(src, row_bytes, N, K, dst, p0, p1);
    case IQ4_XS: return repack_panels_t<IQ4_XS>(src, row_bytes, N, K, dst, p0, p1);
    case MXFP4: return repack_panels_t<MXFP4>(src, row_bytes, N, K, dst, p0, p1);
    default: throw std::invalid_argument("repack_gguf takes ggml's Q8_0, Q4_0, K-family, IQ4 and MXFP4 blocks");
  }
}

}  // namespace tmk
