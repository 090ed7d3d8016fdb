// Portable SIMD for the kernels: GCC/Clang vector extensions of TM_W float lanes.
//
// One source serves every ISA: the build compiles it with TM_W=4 and no ISA flags (the portable "scalar"
// variant: SSE2 on x86-64, NEON on arm64), TM_W=8 with -mavx2 -mfma -mf16c, and TM_W=16 with AVX-512 flags.
// Arithmetic is plain vector code (`acc += a * b` becomes vfmadd under -ffp-contract=fast). The widening
// load (bf16 -> 32-bit lanes) uses the ISA's instructions where there is one: GCC 12 turns a generic
// narrow-to-float vector conversion into scalar code.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#ifndef TM_W
#define TM_W 8
#endif

namespace tmk {

constexpr int W = TM_W;  // float lanes per vector
constexpr int P = 16;    // output channels per weight panel (every packed format); W divides P
constexpr int V = P / W; // vectors per panel row
static_assert(P % W == 0, "the lane count must divide the panel width");

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vu16 __attribute__((vector_size(W * 2)));

inline vf splat(float x) {
#if TM_W == 8 && defined(__AVX2__)
  return (vf)_mm256_set1_ps(x);
#elif TM_W == 16 && defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#else
  vf v;
  for (int i = 0; i < W; ++i) v[i] = x;
  return v;
#endif
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// W bfloat16 values -> W floats: a bf16 is the top half of a float's bits.
inline vf load_bf16(const uint16_t* p) {
#if TM_W == 8 && defined(__AVX2__)
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#elif TM_W == 16 && defined(__AVX512F__)
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#else
  vu16 h;
  std::memcpy(&h, p, sizeof(h));
  vu bits = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// 2W bfloat16 values holding W pairs (a, b) side by side -> the a's (`odd` false) or the b's as floats: each pair
// is one 32-bit lane (a in its low half), and a bf16 is the top half of a float's bits: a = lane << 16, b = lane &
// high.
inline vf load_bf16_half(const uint16_t* p, bool odd) {
  vu lanes;
  std::memcpy(&lanes, p, sizeof(lanes));
  lanes = odd ? lanes & 0xffff0000u : lanes << 16;
  vf f;
  std::memcpy(&f, &lanes, sizeof(f));
  return f;
}

// Both halves at once (the two loads are one).
inline void load_bf16_pair(const uint16_t* p, vf& a, vf& b) {
  a = load_bf16_half(p, false);
  b = load_bf16_half(p, true);
}

// 2^f for f in [-0.5, 0.5]: a degree-6 polynomial, ~1 ulp
inline vf exp2_fraction(vf f) {
  vf p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.f);
  return p;
}

// e^x for x <= 0 (softmax's shifted scores), ~1 ulp: 2^(x log2 e) as 2^n * 2^f, f in [-0.5, 0.5]. Below -87 it
// stays at e^-87 (~1.7e-38, where e^x would go subnormal, then 0): nothing a softmax's sum can see.
inline vf exp_neg(vf x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  vf t = x * splat(1.44269504088896341f);
  vf n = __builtin_convertvector(__builtin_convertvector(t + (t < splat(0.f) ? splat(-0.5f) : splat(0.5f)), vi), vf);
  const vf p = exp2_fraction(t - n);  // 2^f, f in [-0.5, 0.5]
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// e^x for any x, as exp_neg but n rounded by adding 1.5 * 2^23 (whose float has n in its low bits; no conversions)
// and 2^n built from those bits: a sigmoid's e^-g. Above ~88.7 it overflows to inf, as std::exp does; below -87 it
// stays at ~e^-87 (1 + e^x does not see the difference).
inline vf exp_any(vf x) {
  constexpr float SHIFT = 12582912.f;  // 1.5 * 2^23
  x = x < splat(-87.f) ? splat(-87.f) : x;
  x = x > splat(88.8f) ? splat(88.8f) : x;
  const vf t = x * splat(1.44269504088896341f);
  const vf shifted = t + splat(SHIFT);  // bits: SHIFT's, plus n in the mantissa
  const vf p = exp2_fraction(t - (shifted - splat(SHIFT)));  // 2^f, f in [-0.5, 0.5]
  vu bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  bits = (bits << 23) + (127u << 23);  // SHIFT's own bits shift out: (n + 127) << 23, 2^n (n = 128: inf)
  vf scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// the sum of v's lanes: halves added in a tree where the ISA has the shuffles (a scalar chain of W adds cost
// decode attention, one sum per position and head, ~3x)
inline float hsum(vf v) {
#if TM_W == 16 && defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif TM_W == 8 && defined(__AVX2__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

// {hsum(a), hsum(b), hsum(c), hsum(d)} -> out[0..4): one shuffle tree for the four (decode attention's scores)
inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
#if (TM_W == 16 && defined(__AVX512DQ__)) || (TM_W == 8 && defined(__AVX2__))
  auto half = [](vf v) {
#if TM_W == 16
    return _mm256_add_ps(_mm512_castps512_ps256((__m512)v), _mm512_extractf32x8_ps((__m512)v, 1));
#else
    return (__m256)v;
#endif
  };
  // per 128-bit lane: [a0+a1, a2+a3, b0+b1, b2+b3] and c's, d's; then [sum a, sum b, sum c, sum d]
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
#else
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
#endif
}

// IEEE half -> float, for the per-block scales of Q8_0 / Q4_0 (read once per block, scalar is fine).
inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// float -> bfloat16 with round-to-nearest-even (NaN stays NaN), as torch rounds.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return (uint16_t)(bits >> 16);
}

// fn(std::integral_constant<int, rows>{}) for LO <= rows <= MT: a register tile's row count must be a template
// argument, so the remainder of M is dispatched to the tile of exactly that many rows.
template <int MT, int LO = 1, typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (MT > LO) {
    if (rows < MT) return with_rows<MT - 1, LO>(rows, fn);
  }
  fn(std::integral_constant<int, MT>{});
}

// whether any lane of v is a NaN
inline bool any_nan(vf v) {
#if TM_W == 8 && defined(__AVX2__)
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q)) != 0;
#elif TM_W == 16 && defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, (__m512)v, _CMP_UNORD_Q) != 0;
#else
  for (int i = 0; i < W; ++i)
    if (v[i] != v[i]) return true;
  return false;
#endif
}

// W floats rounded to bfloat16 as float_to_bf16 rounds (nearest even; a NaN stays a NaN), kept as floats. Without
// NaNs (one compare and a branch) the rounding alone: half the instructions (SiLU's two roundings per value)
inline vf bf16_rounded(vf f) {
  vu bits;
  std::memcpy(&bits, &f, sizeof(bits));
  vu r = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;  // nearest even
  if (any_nan(f)) {
    const vu nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where a NaN
    const vu quiet = (bits | 0x400000u) & 0xffff0000u;
    r = (nan & quiet) | (~nan & r);
  }
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

// W floats stored as bfloat16 at p, each as float_to_bf16 rounds it
inline void store_bf16(uint16_t* p, vf f) {
  const vf r = bf16_rounded(f);
  vu bits;
  std::memcpy(&bits, &r, sizeof(bits));
  const vu16 top = __builtin_convertvector(bits >> 16, vu16);
  std::memcpy(p, &top, sizeof(top));
}

// This CPU is Intel's (cpuid's vendor string): the weight prefetch below, and whether gemm.h's one-row pair tile
// prefetches at all, differ by vendor because the two vendors' cores were measured to differ.
inline const bool intel_cpu = [] {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  return __get_cpuid(0, &a, &b, &c, &d) && b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;
#else
  return false;
#endif
}();

// An AMD core with AVX-512 (Zen 4 and later), which prefetches weights as Intel's do, only further ahead.
inline const bool amd_avx512 = [] {
#if defined(__x86_64__) || defined(__i386__)
  return !intel_cpu && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}();

// Ask for the line at `at` into L2. An asm statement rather than __builtin_prefetch: GCC 12 (-O3) deleted loops whose
// only statements were __builtin_prefetch calls. attention.h's prefetch loops left no prefetch instruction in the
// object code, and measured as no change at all.
inline void prefetch_l2(const void* at) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*(const char*)at));
#else
  __builtin_prefetch(at, 0, 2);
#endif
}

// every line of the `bytes` at `at` (the first from its line's start) into L2
inline void prefetch_range_l2(const void* at, int64_t bytes) {
  const uintptr_t end = (uintptr_t)at + bytes;
  for (uintptr_t line = (uintptr_t)at & ~uintptr_t{63}; line < end; line += 64) prefetch_l2((const void*)line);
}

// Ask for the weight line a prefetch distance past `at`, as the tiles stream their panels. On Intel into L2 only,
// 3 KB ahead: a prefetch into L1 holds one of its few fill buffers until the line arrives, and those are what the
// tile's own loads wait on (Xeon with AMX, ~1 GB of weights from memory, 2 threads: bf16 1 row 26.9 -> 28.3
// GB/s, 2 rows 22.9 -> 28.4; Q8_0 1 row 24.1 -> 26.6, 4 rows 18.8 -> 22.5; Q4_0 1 row 20.4 -> 24.4; 2 KB or 4 KB
// ahead, or prefetcht2/nta, did less). A Zen 4 too, 6 KB ahead: its tiles of 8-12 rows spend 8-12 cycles on each
// 64-byte line, so 2 KB ahead was ~100 ns of warning, less than memory takes (decode steps of Qwen2.5-0.5B,
// bf16, runs alternated: 16 rows 62.4-69.7 -> 57.7-59.4 ms, 4 rows 35.7 -> 28.8-32.2; 1 row and the quantized
// formats the same within noise; 4 or 8 KB ahead did less). Other AMD cores into L1, 2 KB ahead, as measured on a Zen 3. The AMX tiles (amx.h) do not
// prefetch: at 16 rows it cost them 27.2 -> 25.8 GB/s.
inline void prefetch_weights(const void* at) {
  if (intel_cpu) __builtin_prefetch((const char*)at + 3072, 0, 2);
  else if (amd_avx512) __builtin_prefetch((const char*)at + 6144, 0, 2);
  else __builtin_prefetch((const char*)at + 2048, 0, 3);
}

}  // namespace tmk
