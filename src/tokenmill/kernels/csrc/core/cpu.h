// What the kernels ask of the CPU beyond its ISA: its vendor (the weight prefetch distance differs by vendor) and
// the prefetch instructions.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace tmk {

// This CPU is Intel's (cpuid's vendor string): the weight prefetch below, and whether the one-row bf16 pair tile
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

// A Zen 4 (AMD family 0x19 with AVX-512): it runs each zmm instruction as two 256-bit halves, so from 1 to 3 rows
// the quantized tiles keep to ymm registers there (arch/avx512bf16/qtile512.h, linear/kquant.h). A Zen 5 (family
// 0x1A) has full-width 512-bit units and takes the zmm tiles from one row: on one (2026-12-02, scripts/kernel_ab.py,
// 6 layers of the 1.5B shape) they ran Q5_K 1.9-2.4x, Q6_K 1.1-1.8x, Q4_0 1.2-1.4x and Q4_K 1.1-1.5x faster at 1 to 3
// rows than the ymm ones, Q8_0 the same. Not const: tests force either path on any CPU (`set_half_width`).
inline bool amd_half_width_512 = [] {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!amd_avx512 || !__get_cpuid(1, &a, &b, &c, &d)) return false;
  const unsigned base = (a >> 8) & 0xF, family = base == 0xF ? base + ((a >> 20) & 0xFF) : base;
  return family <= 0x19;
#else
  return false;
#endif
}();

// Ask for the line at `at` into L2. An asm statement rather than __builtin_prefetch: GCC 12 (-O3) deleted loops whose
// only statements were __builtin_prefetch calls. Decode attention's prefetch loops left no prefetch instruction in the
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
// tile's own loads wait on. A Zen 4 too, 6 KB ahead: its tiles of 8-12 rows spend 8-12 cycles on each 64-byte
// line, so 2 KB ahead warns less than memory takes. Other AMD cores into L1, 2 KB ahead. The AMX tiles
// (arch/amx/) do not prefetch: it slowed them. The distances were measured, per vendor: docs/benchmarks.md.
inline void prefetch_weights(const void* at) {
  if (intel_cpu) __builtin_prefetch((const char*)at + 3072, 0, 2);
  else if (amd_avx512) __builtin_prefetch((const char*)at + 6144, 0, 2);
  else __builtin_prefetch((const char*)at + 2048, 0, 3);
}

}  // namespace tmk
