// The machine's arithmetic peaks, as the instructions the linears run on reach them (`tokenmill bench probe`): each
// thread of torch's pool runs independent accumulator chains of one instruction, with nothing loaded or stored in
// the loop, and the call returns the operations it did, counted exactly (a multiply-add is 2 operations):
//   fma     the widest float vector FMA (vfmadd231ps zmm / ymm; a mul and an add where the build has no FMA): 2 a lane
//   dpbf16  vdpbf16ps zmm (AVX-512 BF16): 2 bf16 multiply-adds into each float32 lane, 4 operations a lane
//   dpbusd  vpdpbusd (VNNI, zmm or ymm): 4 u8 x s8 multiply-adds into each int32 lane, 8 operations a lane
//   amx_*   tdpbf16ps / tdpbusd (arch/amx/peak.h): 16 x 16 sums of 32 bf16 / 64 int8 products each, a tile
// kChains chains cover the instruction's latency x throughput (4 cycles x 2 ports: 8 in flight) with room to spare,
// and fit 16 ymm registers beside the two operands.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "arch/isa.h"
#include "core/simd.h"

#if TM_AMX
#include "arch/amx/peak.h"
#endif

namespace tmk {

constexpr int kChains = 12;

// Hide v's value from the optimizer, with no instruction: chains started alike would otherwise be merged into one
// (GCC did: twelve equal chains became one vfmadd a round). In a register where v fits one, else through memory
// (the test-only 16-lane code on AVX2), once, before the loop.
template <typename T>
inline void opaque(T& v) {
#if defined(__AVX512F__)
  constexpr size_t reg = 64;
#elif defined(__AVX__)
  constexpr size_t reg = 32;
#else
  constexpr size_t reg = 16;
#endif
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (sizeof(T) <= reg) asm volatile("" : "+v"(v));
  else asm volatile("" : "+m"(v));
#elif defined(__aarch64__)
  if constexpr (sizeof(T) <= reg) asm volatile("" : "+w"(v));
  else asm volatile("" : "+m"(v));
#else
  asm volatile("" : "+m"(v));
#endif
}

enum PeakKind : int64_t { kFma = 0, kDpbf16 = 1, kDpbusd = 2, kAmxBf16 = 3, kAmxInt8 = 4 };

// One task's `iters` rounds of kChains chains acc = acc * m + c on W lanes; the sum of the lanes. With m = c = 1
// every lane ends at `iters` (exactly, below 2^24): the tests' check that every round ran.
inline double fma_chains(int64_t iters, float m, float c) {
  const vf mv = splat(m), cv = splat(c);
  vf acc[kChains] = {};
  for (auto& a : acc) opaque(a);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < kChains; ++k) acc[k] = acc[k] * mv + cv;  // one FMA (-ffp-contract=fast)
  }
  vf s = {};
  for (int k = 0; k < kChains; ++k) s += acc[k];
  return hsum(s);
}

#if TM_BF16_PAIRS
// vdpbf16ps: pairs of bf16 `value` (its top 16 bits) multiplied into float32 sums, 2 products a lane a round
inline double dpbf16_chains(int64_t iters, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const __m512bh v = (__m512bh)_mm512_set1_epi32((int)((bits >> 16) * 0x10001u));
  __m512 acc[kChains];
  for (auto& a : acc) a = _mm512_setzero_ps(), opaque(a);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < kChains; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], v, v);
  }
  __m512 s = _mm512_setzero_ps();
  for (int k = 0; k < kChains; ++k) s = _mm512_add_ps(s, acc[k]);
  return _mm512_reduce_add_ps(s);
}
#endif

#if TM_VNNI
// vpdpbusd on the widest registers the build has: 4 products of u8 `u` by s8 `s` into each int32 lane, a round.
// Written as asm: GCC copied every accumulator through a second register (and the stack) around the intrinsic.
// The sums wrap past 2^31 (a probe that runs long): only the tests' short runs read them.
inline double dpbusd_chains(int64_t iters, int8_t u, int8_t s) {
#if TM_Q512
  using V = __m512i;
  const V a = _mm512_set1_epi8(u), b = _mm512_set1_epi8(s);
#define TM_PEAK_DPBUSD "vpdpbusd %2, %1, %0"
#else
  using V = __m256i;
  const V a = _mm256_set1_epi8(u), b = _mm256_set1_epi8(s);
#if defined(__AVX512VNNI__)
#define TM_PEAK_DPBUSD "vpdpbusd %2, %1, %0"
#else
#define TM_PEAK_DPBUSD "%{vex%} vpdpbusd %2, %1, %0"  // (braces escaped: asm dialect marks)
#endif
#endif
  // twelve named accumulators (kChains): in an array that asm statements name, GCC kept them in memory
  V c0 = {}, c1 = {}, c2 = {}, c3 = {}, c4 = {}, c5 = {}, c6 = {}, c7 = {}, c8 = {}, c9 = {}, c10 = {}, c11 = {};
#define TM_PEAK_STEP(acc) asm volatile(TM_PEAK_DPBUSD : "+v"(acc) : "v"(a), "v"(b))
  for (int64_t i = 0; i < iters; ++i) {
    TM_PEAK_STEP(c0); TM_PEAK_STEP(c1); TM_PEAK_STEP(c2); TM_PEAK_STEP(c3); TM_PEAK_STEP(c4); TM_PEAK_STEP(c5);
    TM_PEAK_STEP(c6); TM_PEAK_STEP(c7); TM_PEAK_STEP(c8); TM_PEAK_STEP(c9); TM_PEAK_STEP(c10); TM_PEAK_STEP(c11);
  }
#undef TM_PEAK_STEP
#undef TM_PEAK_DPBUSD
  static_assert(kChains == 12, "dpbusd_chains names its twelve accumulators");
  typedef int32_t vs __attribute__((vector_size(sizeof(V))));
  // the chains' lanes added by value (int32, wrapping as the accumulators do)
  const vs sum = (vs)c0 + (vs)c1 + (vs)c2 + (vs)c3 + (vs)c4 + (vs)c5 + (vs)c6 + (vs)c7 + (vs)c8 + (vs)c9 + (vs)c10 +
                 (vs)c11;
  int32_t lanes[sizeof(V) / 4];
  std::memcpy(lanes, &sum, sizeof(V));
  double total = 0;
  for (int32_t x : lanes) total += x;
  return total;
}
#endif

// The peaks this build and CPU can probe: (kind, instruction, what one operation is)
inline std::vector<std::tuple<int64_t, std::string, std::string>> peak_kinds() {
#if TM_SIMD_AVX512
  const char* fma = "vfmadd231ps zmm";
#elif TM_SIMD_AVX2
  const char* fma = "vfmadd231ps ymm";
#elif defined(__FMA__)
  const char* fma = "vfmadd231ps ymm (two a vector: the 16-lane code on AVX2)";
#elif defined(__aarch64__)
  const char* fma = "fmla (NEON, 4 lanes)";
#else
  const char* fma = "mulps + addps xmm (no FMA in this build)";
#endif
  std::vector<std::tuple<int64_t, std::string, std::string>> kinds{{kFma, fma, "float32"}};
#if TM_BF16_PAIRS
  kinds.emplace_back(kDpbf16, "vdpbf16ps zmm", "bf16 products into float32");
#endif
#if TM_Q512
  kinds.emplace_back(kDpbusd, "vpdpbusd zmm", "int8 products into int32");
#elif TM_VNNI
  kinds.emplace_back(kDpbusd, "vpdpbusd ymm", "int8 products into int32");
#endif
#if TM_AMX
  if (amx_native()) {
    kinds.emplace_back(kAmxBf16, "tdpbf16ps (AMX)", "bf16 products into float32");
    kinds.emplace_back(kAmxInt8, "tdpbusd (AMX)", "int8 products into int32");
  }
#endif
  return kinds;
}

// Operations one task's round does: kChains instructions of `kind`, 2 operations per multiply-add
inline int64_t peak_ops_per_round(int64_t kind) {
  switch (kind) {
    case kFma: return kChains * W * 2;
    case kDpbf16: return kChains * 16 * 2 * 2;        // 16 lanes, 2 products each
    case kDpbusd: return kChains * (TM_Q512 ? 16 : 8) * 4 * 2;  // int32 lanes, 4 products each
#if TM_AMX
    case kAmxBf16: return kAmxTiles * 16 * 16 * 32 * 2;
    case kAmxInt8: return kAmxTiles * 16 * 16 * 64 * 2;
#endif
    default: return 0;
  }
}

// One task's rounds of `kind` (which this build must have: peak_kinds), the sum of its accumulators
inline double peak_task(int64_t kind, int64_t iters, double one) {
  switch (kind) {
    case kFma: return fma_chains(iters, (float)one, (float)one);
#if TM_BF16_PAIRS
    case kDpbf16: return dpbf16_chains(iters, (float)one);
#endif
#if TM_VNNI
    case kDpbusd: return dpbusd_chains(iters, (int8_t)one, (int8_t)one);
#endif
#if TM_AMX
    case kAmxBf16: return amx_peak_bf16(iters, (float)one);
    case kAmxInt8: return amx_peak_int8(iters, (int8_t)one);
#endif
    default: return 0;
  }
}

// Every thread of torch's pool runs `iters` rounds of `kind` (one task a thread): (operations done, their checksum).
// `one` is 1 (a runtime value, so that no product folds away); with it each accumulator lane ends at iters x the
// products a lane sums a round, which the tests compare.
inline std::pair<int64_t, double> peak_probe(int64_t kind, int64_t iters, double one) {
  bool known = false;
  for (const auto& k : peak_kinds()) known = known || std::get<0>(k) == kind;
  if (!known || iters < 1) return {0, 0.0};
  const int64_t tasks = at::get_num_threads();
  std::vector<double> sums(tasks, 0.0);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sums[t] = peak_task(kind, iters, one);
  });
  double total = 0;
  for (double s : sums) total += s;
  return {tasks * iters * peak_ops_per_round(kind), total};
}

}  // namespace tmk
