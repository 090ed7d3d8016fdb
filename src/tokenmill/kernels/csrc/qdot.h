// Quantized weights (Q8_0, Q4_0) times quantized activations, in integer arithmetic, as ggml does it.
//
// Each activation row is quantized once per call to Q8_0 blocks (32 int8 values and one float scale per block;
// `quantize_row`). A block's dot product with a weight block is then an exact sum of int8 x int8 (or uint4 x
// int8) products, scaled once by d_w * d_x. The multiplies are 8-bit: on AVX2, vpmaddubsw multiplies 32 byte
// pairs and adds neighbours into 16-bit lanes, and vpmaddwd adds those into 32-bit lanes, 4 k at a time, so one
// instruction does the work of four float FMAs. For that the weights are stored in groups of 4 k per channel
// (formats.py):
//   Q8_0 block: { fp16 d[16]; int8  q[8][16][4] }  q[g][c][i] = w[c][4g + i]
//   Q4_0 block: { fp16 d[16]; uint8 q[8][8][4] }   q[g][c][i] = w[c][4g + i] | w[c + 8][4g + i] << 4 (w in 0..15,
//                                                  the weight is d * (w - 8))
// so that one 32-byte load holds 8 channels x 4 k (Q8_0), or 16 channels x 4 k in its two nibbles (Q4_0), and
// the row's 4 bytes at k = 4g.. are broadcast to every channel.
//
// vpmaddubsw multiplies an unsigned byte by a signed one and saturates its 16-bit pair sums. Q4_0's nibbles are
// unsigned (0..15): a pair sums to at most 2 * 15 * 127, so all 8 groups of a block add up in 16 bits (30480
// < 32767) before one vpmaddwd. Q8_0 takes |w| as the unsigned side and moves w's sign onto x (vpsignb), so a
// pair sums to at most 2 * 128 * 127 < 32767; its groups widen to 32 bits one by one. The -8 of Q4_0 is
// subtracted once per block as 8 * (sum of the row's q over the block).
//
// With VNNI (AVX-512 VNNI with VL, or AVX-VNNI), vpdpbusd multiplies the same byte pairs and adds groups of 4
// straight into 32-bit lanes: one instruction for vpmaddubsw + vpmaddwd + vpaddd, and the same exact sums (none
// of them saturates above). Its 32-bit sums cannot saturate at all, so Q8_0 there takes x + 128 as the unsigned
// side and w as it is, and subtracts 128 * (sum of w) per channel and block, as Q4_0 subtracts its 8. The
// portable variant (no AVX2) runs the same integer sums in plain loops: the numbers are the same.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "gemm.h"

// vpdpbusd on ymm registers: AVX-512 VNNI's (EVEX, with VL), or AVX-VNNI's (VEX: Intel's client cores from Alder
// Lake on, which have no AVX-512); the same operation either way
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TM_VNNI 1
#define tm_dpbusd256 _mm256_dpbusd_epi32
#elif defined(__AVXVNNI__)
#define TM_VNNI 1
#define tm_dpbusd256 _mm256_dpbusd_avx_epi32
#else
#define TM_VNNI 0
#endif
// the avxvnni variant (VNNI on 8 lanes): from 4 rows, the wide tiles (qwide.h)
#define TM_WIDE (TM_VNNI && TM_W == 8)

namespace tmk {

constexpr int64_t QMC = 64;  // rows per block: their quantized x (64 x K bytes) stays in L2 across the panels
// rows per register tile: with 16 vector registers 4 rows spill the accumulators (Q4_0 1.25x slower on Zen 3);
// AVX-512's 32 hold more, and more rows per weight load win there (Zen 4, weights from memory, 8 rows against 4:
// Q4_0 6-16 rows 1.05-1.25x, Q8_0 1.15-1.2x; 6 rows fall between)
#if defined(__AVX512F__)
constexpr int MT_Q = 8;
#else
constexpr int MT_Q = 3;
#endif

// A quantized activation row, in place of K floats: float d[nb], int32 o[nb][2] = {-8 s, -128 s} where s is the
// block's sum of q (Q4_0's offsets: its tiles start a block's integer sums there, o[b][1] for the high nibbles kept
// in place, 16 times their weight), int8 q[K], and with VNNI, for Q8_0 weights, uint8 u[K] = q + 128 (the unsigned
// side of vpdpbusd). qrow() is the one place that knows the layout.
struct QRow {
  const float* d;
  const int32_t* o;
  const int8_t* q;
  const uint8_t* u;
};

inline QRow qrow(const float* row, int64_t nb) {
  const int8_t* q = (const int8_t*)(row + 3 * nb);
  return {row, (const int32_t*)(row + nb), q, (const uint8_t*)q + nb * QK};
}

// x[0..K) float32 -> the QRow layout at `dst` (which has room for K floats): per block of 32, d = max|x| / 127 and
// q = x / d rounded to nearest, ties to even (as ggml's AVX2 quantize_row_q8_0), the scale kept in float32; with
// `for_q8_0` and VNNI also u = q + 128. Only the blocks [b0, b1) where b1 >= 0 (the row in parts, by threads).
inline void quantize_row(const float* x, int64_t K, float* dst, bool for_q8_0 = false, int64_t b0 = 0,
                         int64_t b1 = -1) {
  const int64_t nb = K / QK;
  if (b1 < 0) b1 = nb;
  const QRow row = qrow(dst, nb);
  int32_t* o = (int32_t*)row.o;
  int8_t* q = (int8_t*)row.q;
  for (int64_t b = b0; b < b1; ++b) {
    const float* xb = x + b * QK;
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i), mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#else
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
#if defined(__AVX2__)
    __m256i r[4];
    for (int i = 0; i < 4; ++i)
      r[i] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i*)lanes, total);
    for (int i = 0; i < 8; ++i) sum += lanes[i];
    // int32 -> int8: the packs interleave 128-bit lanes; the permute puts the 8 groups of 4 back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256((__m256i*)(q + b * QK),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int i = 0; i < QK; ++i) {
      const int32_t v = (int32_t)std::nearbyint(xb[i] * id);  // |v| <= 127; ties to even in the default mode
      q[b * QK + i] = (int8_t)v;
      sum += v;
    }
#endif
    dst[b] = d;
    o[2 * b] = -8 * sum, o[2 * b + 1] = -128 * sum;
  }
#if TM_VNNI
  uint8_t* u = (uint8_t*)row.u;
  for (int64_t k = b0 * QK; for_q8_0 && k < b1 * QK; ++k) u[k] = (uint8_t)q[k] ^ 0x80;
#else
  (void)for_q8_0;
#endif
}

// The raw weight value of channel c at k = kk of a quantized block (Q4_0: 0..15), for unpacking and the portable
// tile.
template <Format F>
inline int32_t block_value(const uint8_t* q, int c, int kk) {
  const int g = kk / 4, i = kk % 4;
  if constexpr (F == Q8_0) return ((const int8_t*)q)[g * 64 + c * 4 + i];
  const uint8_t byte = q[g * 32 + (c % 8) * 4 + i];
  return c < 8 ? byte & 15 : byte >> 4;
}

#if defined(__AVX512F__)
inline const bool prefetch_quant_rows = !amd_avx512;
#else
inline const bool prefetch_quant_rows = true;
#endif

#if defined(__AVX2__) && defined(__F16C__)
// Q4_0: MT rows' exact integer sums over the block at q (its 8 groups of 32 bytes) -> isum[m][0] channels 0-7,
// isum[m][1] 8-15, the row's -8 * (sum of its q) included (QRow::o)
template <int MT>
inline void q4_block_sums(const uint8_t* q, const QRow* x, int64_t b, __m256i (*isum)[2]) {
  const __m256i low = _mm256_set1_epi8(15);
  __m256i p[MT][2];
  for (int m = 0; m < MT; ++m) {
#if TM_VNNI  // the sums start at the offsets; the high half's at 16 times its own
    p[m][0] = _mm256_set1_epi32(x[m].o[2 * b]), p[m][1] = _mm256_set1_epi32(x[m].o[2 * b + 1]);
#else  // 16-bit sums: the offset comes after they widen
    p[m][0] = p[m][1] = _mm256_setzero_si256();
#endif
  }
  // NOTE: the AVX2 build, unrolled whole, computes every product first and spills them to the stack; the avxvnni
  // one spills its accumulators on every pass of a loop unrolled by 2 from 4 rows on (Xeon, kernel_ab.py at 8-64
  // rows: 1.09-1.15x unrolled whole)
#if TM_WIDE
#pragma GCC unroll 8
#else
#pragma GCC unroll 2
#endif
  for (int g = 0; g < QK / 4; ++g) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i*)(q + g * 32));
#if TM_VNNI
    // the high nibbles in place, 16 times their weight (no 16-bit sums to overflow here): shifted out below
    const __m256i w0 = _mm256_and_si256(bytes, low), w1 = _mm256_andnot_si256(low, bytes);
#else
    const __m256i w0 = _mm256_and_si256(bytes, low), w1 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
#endif
    for (int m = 0; m < MT; ++m) {
      int32_t four;
      std::memcpy(&four, x[m].q + b * QK + 4 * g, 4);
      const __m256i xb = _mm256_set1_epi32(four);
#if TM_VNNI
      p[m][0] = tm_dpbusd256(p[m][0], w0, xb);  // 32-bit sums of 4 products at once
      p[m][1] = tm_dpbusd256(p[m][1], w1, xb);
#else
      p[m][0] = _mm256_add_epi16(p[m][0], _mm256_maddubs_epi16(w0, xb));
      p[m][1] = _mm256_add_epi16(p[m][1], _mm256_maddubs_epi16(w1, xb));
#endif
    }
  }
  for (int m = 0; m < MT; ++m) {
#if TM_VNNI
    isum[m][0] = p[m][0];
    isum[m][1] = _mm256_srai_epi32(p[m][1], 4);  // exact: 16 * (sum - 8 s), |sum - 8 s| < 2^16
#else
    const __m256i ones = _mm256_set1_epi16(1), offset = _mm256_set1_epi32(x[m].o[2 * b]);
    for (int h = 0; h < 2; ++h) isum[m][h] = _mm256_add_epi32(_mm256_madd_epi16(p[m][h], ones), offset);
#endif
  }
}

#if TM_VNNI
// Q8_0: MT rows' sums += (x + 128) at group g of block b (QRow::u) times the group's weights (w0 channels 0-7, w1
// 8-15)
template <int MT>
inline void q8_group(const QRow* x, int64_t b, int g, __m256i w0, __m256i w1, __m256i (*isum)[2]) {
  for (int m = 0; m < MT; ++m) {
    int32_t four;
    std::memcpy(&four, x[m].u + b * QK + 4 * g, 4);
    const __m256i xu = _mm256_set1_epi32(four);
    isum[m][0] = tm_dpbusd256(isum[m][0], xu, w0);
    isum[m][1] = tm_dpbusd256(isum[m][1], xu, w1);
  }
}
#endif

// MT rows x the panel's 16 channels -> sums[m][0..16) = sum over the blocks of isum * (d_w * d_x), over blocks
// [b0, b1): from zero at b0 = 0, else on from `sums`; `prefetch`: ask for the weights ahead (qpanel's first tile)
template <Format F, int MT>
inline void qtile(const uint8_t* panel, const QRow* x, int64_t b0, int64_t b1, float (*sums)[P], bool prefetch) {
  __m256 acc[MT][2];
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) acc[m][h] = b0 ? _mm256_loadu_ps(sums[m] + 8 * h) : _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);  // (vpmaddwd's; VNNI needs none)
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = panel + b * quant_block_bytes(F);
    // the weights ahead, as gemm.h's prefetch_ahead (Zen 3, from memory: 1 row 1.22x, 5 rows 1.03-1.12x). Not on a
    // Zen 4, whose AVX-512 build takes only 1-3 rows here: those stream best on the hardware's prefetch alone, as
    // gemm.h's one-row pair tile does (int8 decode steps of Qwen2.5-0.5B, builds alternated in one process: 1 row
    // 18.3 -> 16.7 and 17.8 -> 16.2 ms, 2 and 3 rows 0.93x; int4 1 row the same within noise, 2 rows 0.9x)
    if (prefetch_quant_rows && prefetch)
      for (int64_t off = 0; off < quant_block_bytes(F); off += 64) prefetch_weights(blk + off);
    const uint8_t* q = blk + 2 * P;
    __m256i isum[MT][2];
    if constexpr (F == Q4_0) {
      q4_block_sums<MT>(q, x, b, isum);
    } else {
      for (int m = 0; m < MT; ++m) isum[m][0] = isum[m][1] = _mm256_setzero_si256();
#if TM_VNNI
      // x + 128 (QRow::u, unsigned) times w (signed), less 128 * the block's sum of w per channel (itself one
      // vpdpbusd by ones per group, shared by the tile's rows): the same exact sums, without a vpsignb per row
      __m256i wsum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      const __m256i ones8 = _mm256_set1_epi8(1);
#pragma GCC unroll 2
      for (int g = 0; g < QK / 4; ++g) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(q + g * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(q + g * 64 + 32));
        wsum[0] = tm_dpbusd256(wsum[0], ones8, w0);
        wsum[1] = tm_dpbusd256(wsum[1], ones8, w1);
        q8_group<MT>(x, b, g, w0, w1, isum);
      }
      const __m256i c0 = _mm256_slli_epi32(wsum[0], 7), c1 = _mm256_slli_epi32(wsum[1], 7);
      for (int m = 0; m < MT; ++m) {
        isum[m][0] = _mm256_sub_epi32(isum[m][0], c0);
        isum[m][1] = _mm256_sub_epi32(isum[m][1], c1);
      }
#else
#pragma GCC unroll 2
      for (int g = 0; g < QK / 4; ++g) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i*)(q + g * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i*)(q + g * 64 + 32));
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int m = 0; m < MT; ++m) {
          int32_t four;
          std::memcpy(&four, x[m].q + b * QK + 4 * g, 4);
          const __m256i xb = _mm256_set1_epi32(four);
          const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
          const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
          isum[m][0] = _mm256_add_epi32(isum[m][0], _mm256_madd_epi16(p0, ones));
          isum[m][1] = _mm256_add_epi32(isum[m][1], _mm256_madd_epi16(p1, ones));
        }
      }
#endif
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)));
    for (int m = 0; m < MT; ++m) {
      const __m256 dx = _mm256_set1_ps(x[m].d[b]);
      acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][0]), _mm256_mul_ps(d0, dx), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m][1]), _mm256_mul_ps(d1, dx), acc[m][1]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm256_storeu_ps(sums[m], acc[m][0]);
    _mm256_storeu_ps(sums[m] + 8, acc[m][1]);
  }
}
#else
template <Format F, int MT>
inline void qtile(const uint8_t* panel, const QRow* x, int64_t b0, int64_t b1, float (*sums)[P], bool) {
  if (b0 == 0)
    for (int m = 0; m < MT; ++m) std::fill(sums[m], sums[m] + P, 0.f);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = panel + b * quant_block_bytes(F);
    float dw[P];
    for (int c = 0; c < P; ++c) dw[c] = half_to_float(((const uint16_t*)blk)[c]);
    for (int m = 0; m < MT; ++m) {
      int32_t isum[P] = {};
      for (int kk = 0; kk < QK; ++kk) {
        const int32_t xq = x[m].q[b * QK + kk];
        for (int c = 0; c < P; ++c) isum[c] += block_value<F>(blk + 2 * P, c, kk) * xq;
      }
      for (int c = 0; c < P; ++c) {
        if constexpr (F == Q4_0) isum[c] += x[m].o[2 * b];
        sums[m][c] += (float)isum[c] * (dw[c] * x[m].d[b]);
      }
    }
  }
}
#endif

// `rows` <= MT rows in the tile of exactly that many
template <Format F, int MT>
inline void qtile_rows(const uint8_t* panel, const QRow* x, int64_t nb, float (*sums)[P], int64_t rows) {
  with_rows<MT>(rows, [&](auto r) { qtile<F, decltype(r)::value>(panel, x, 0, nb, sums, true); });
}

}  // namespace tmk

#include "qdot512.h"
#include "qwide.h"

namespace tmk {

// A panel times mc rows in register tiles (the builds below AVX-512).
//
// The tiles of MT_Q rows (3; 8 in the avx512 build) run span by span of K (~8 KB of the panel), as the bf16 tiles
// do (dense.h: panel_spans): every tile runs over a span before the next span starts, so its weights come from
// memory once, for the first tile (which alone prefetches), and stay in L1 for the later tiles. Their float sums
// wait in `sums` between spans, one block after another as in one pass: the same bits. Xeon, decode steps of
// Qwen2.5-0.5B alternated in one process, the avx2 build (Zen 3's): int8 16 rows 1.073x, 8 rows 1.01x, 4 rows
// 1.03x; int4 16 rows 1.01x, 4 rows 1.02x; the avx512 build's int8 at 16 rows 0.999x. Tried and not kept: the
// tiles sharing the next span's prefetch (int8 4-8 rows 0.81-0.92x), and spans for the avxvnni build's wide tiles
// (int8 16 rows 0.99x, 8 rows 0.97x; int4 1.01x).
template <Format F>
inline void qpanel(const uint8_t* panel, const QRow* x, int64_t nb, float (*sums)[P], int64_t mc) {
#if TM_WIDE
  if (mc > MT_Q) {
    // the rows in the fewest tiles of at most MT_WIDE (16 rows as 6 + 6 + 4)
    const int64_t tiles = (mc + MT_WIDE - 1) / MT_WIDE, per = (mc + tiles - 1) / tiles;
    thread_local std::vector<int32_t> corr;
    if (F == Q8_0) corr.resize(nb * P), q8_corrections(panel, nb, corr.data());
    for (int64_t m = 0; m < mc; m += per)
      with_rows<MT_WIDE>(std::min<int64_t>(per, mc - m), [&](auto r) {
        constexpr int R = decltype(r)::value;
        if constexpr (R <= MT_Q) qtile<F, R>(panel, x + m, 0, nb, sums + m, true);
        else qtile_wide<F, R>(panel, corr.data(), x + m, nb, sums + m);
      });
    return;
  }
#endif
  const int64_t tiles = (mc + MT_Q - 1) / MT_Q, bb = quant_block_bytes(F);
  const int64_t span = kspans && tiles > 1 ? std::min(nb, std::max<int64_t>(1, SPAN_BYTES / bb)) : nb;
  for (int64_t b0 = 0; b0 < nb; b0 += span) {
    const int64_t b1 = std::min(nb, b0 + span);
    for (int64_t m = 0; m < mc; m += MT_Q) {
      // in one pass every tile prefetches as it goes; in spans the first (the others find the span in L1)
      with_rows<MT_Q>(std::min<int64_t>(MT_Q, mc - m), [&](auto r) {
        qtile<F, decltype(r)::value>(panel, x + m, b0, b1, sums + m, span == nb || m == 0);
      });
    }
  }
}

// Output panels [p_begin, p_end) of out[M, N] = x[M, K] @ w^T (+ bias), x rows in the QRow layout `ldx` floats
// apart: for each block of QMC rows, every panel passes over them in tiles of MT_Q rows. A row's blocks are summed
// in the same order whatever M is, so its output does not depend on the batch.
template <Format F>
void linear_quant(const float* x, int64_t M, int64_t ldx, const uint8_t* packed, int64_t N, int64_t K,
                  const float* bias, float* out32, uint16_t* out16, int64_t p_begin, int64_t p_end) {
  const int64_t nb = K / QK, stride = panel_bytes(F, K);
  QRow rx[QMC];
  float sums[QMC][P];
  for (int64_t m0 = 0; m0 < M; m0 += QMC) {
    const int64_t mc = std::min(QMC, M - m0);
    for (int64_t r = 0; r < mc; ++r) rx[r] = qrow(x + (m0 + r) * ldx, nb);
#if TM_Q512
    // the block's rows in the fewest tiles, of even sizes (12 rows as 6 + 6, not 8 + 4)
    const int64_t tiles = (mc + MT_Q512 - 1) / MT_Q512, per = (mc + tiles - 1) / tiles;
#endif
    for (int64_t p = p_begin; p < p_end; ++p) {
#if TM_Q512
      for (int64_t m = 0; m < mc; m += per) {
        const uint8_t* panel = packed + p * stride;
        const int64_t rows = std::min<int64_t>(per, mc - m);
        // 1-3 rows: the ymm tiles on a Zen 4 (1 row: 1.07x), the zmm ones on Intel (qdot512.h)
        if (rows < 4 && amd_avx512) qtile_rows<F, 3>(panel, rx + m, nb, sums + m, rows);
        else with_rows<MT_Q512>(rows, [&](auto r) { qtile512<F, decltype(r)::value>(panel, rx + m, nb, sums + m); });
      }
#else
      qpanel<F>(packed + p * stride, rx, nb, sums, mc);
#endif
      const int64_t n0 = p * P, n_valid = std::min<int64_t>(P, N - n0);
      for (int64_t r = 0; r < mc; ++r) store_outputs(sums[r], m0 + r, n0, n_valid, N, bias, out32, out16);
    }
  }
}

}  // namespace tmk
