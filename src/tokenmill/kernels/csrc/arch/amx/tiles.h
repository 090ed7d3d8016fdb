// What the AMX tiles need from the CPU and the OS: AMX-TILE, AMX-BF16 and AMX-INT8, and Linux's permission to use
// the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM); a kernel that refuses leaves AMX off); and the tile
// configuration's layout.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "arch/isa.h"

#if !TM_AMX
#error "arch/amx/ is the avx512bf16 variant's, on x86-64 Linux"
#endif

namespace tmk {

// The CPU has AMX-TILE, AMX-BF16 and AMX-INT8, and this process may use them.
inline bool amx_native() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;  // AMX-BF16, -TILE, -INT8
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace tmk
