// What this build of the kernels may use, decided once from the compiler's ISA macros and TM_W (kernels/isa.py:
// COMPILE_FLAGS, LANES; build.py passes -DTM_W). Every per-ISA choice in the tree reads these names, and the
// dispatch headers (core/simd.h, linear/*.h, attention/*.h) include the one arch/<variant>/ file that implements
// each piece for this build:
//   arch/generic/     portable C++ (the scalar variant, and whatever a build has no instructions for)
//   arch/avx2/        8-lane vectors; the ymm integer tiles of the quantized formats (every x86 variant's)
//   arch/avxvnni/     the wide quantized tiles of the avxvnni variant (VNNI on 8 lanes)
//   arch/avx512/      16-lane vectors
//   arch/avx512bf16/  vdpbf16ps pair tiles and bf16 decode attention; the zmm VNNI quantized tiles (also the
//                     avx512vnni variant's: AVX-512 VNNI without BF16, Cascade Lake and Ice Lake)
//   arch/amx/         AMX tiles (in the avx512bf16 variant, taken only where the CPU and Linux allow them)
#pragma once

#ifndef TM_W
#define TM_W 8  // float lanes per vector
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// the vector layer (core/simd.h): 16-lane AVX-512 or 8-lane AVX2 instructions, else portable vector code (also
// the test-only 16-lane build with AVX2 flags)
#if TM_W == 16 && defined(__AVX512F__)
#define TM_SIMD_AVX512 1
#else
#define TM_SIMD_AVX512 0
#endif
#if TM_W == 8 && defined(__AVX2__)
#define TM_SIMD_AVX2 1
#else
#define TM_SIMD_AVX2 0
#endif

// the quantized formats' integer tiles on ymm registers (arch/avx2/qtile.h), whatever TM_W is
#if defined(__AVX2__) && defined(__F16C__)
#define TM_INT8_YMM 1
#else
#define TM_INT8_YMM 0
#endif

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

// the avxvnni variant (VNNI on 8 lanes): from 4 rows, the wide tiles (arch/avxvnni/qwide.h)
#define TM_WIDE (TM_VNNI && TM_W == 8)

// AVX-512 VNNI on zmm registers: the quantized tiles of arch/avx512bf16/qtile512.h
#if TM_W == 16 && TM_VNNI && defined(__AVX512BW__)
#define TM_Q512 1
#else
#define TM_Q512 0
#endif

// 32 vector registers (AVX-512): room for more rows per register tile
#if defined(__AVX512F__)
#define TM_REGS32 1
#else
#define TM_REGS32 0
#endif

// vdpbf16ps: bf16 pairs multiplied in one instruction (the dense pair tiles, decode attention's keys)
#if defined(__AVX512BF16__) && TM_W == 16
#define TM_BF16_PAIRS 1
#else
#define TM_BF16_PAIRS 0
#endif

// AMX tiles may be compiled in (per-function target flags); amx_native() says whether this CPU and process have them
#if TM_BF16_PAIRS && defined(__x86_64__) && defined(__linux__)
#define TM_AMX 1
#else
#define TM_AMX 0
#endif
