// The AMX tiles of the linear layer (arch/amx/ where the build has them, else arch/generic/no_amx.h) and the switch
// that lets them run: linear_amx (bf16 weights times bf16 rows), linear_amx_q<F> (Q8_0 / Q4_0 weights times
// quantized rows) and linear_amx_k<F> (the K family's, the same rows). The format table (linear/type_traits.h) says which formats take them and from how many rows.
#pragma once

#include "arch/isa.h"

#if TM_AMX
#include "arch/amx/amx_bf16.h"
#include "arch/amx/amx_int8.h"
#include "arch/amx/amx_kquant.h"
#else
#include "arch/generic/no_amx.h"
#endif

namespace tmk {

// -1: AMX for bf16 and the quantized formats where amx_native() (the default); 0: never; 1: from one row (tests)
inline int amx_mode = -1;
inline bool use_amx() { return amx_mode != 0 && amx_native(); }

}  // namespace tmk
