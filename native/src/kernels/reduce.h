// Element-wise reduction kernels for every DType x ReduceOp, chosen at run time for the CPU
// (the shipped build must run on any x86-64, so SIMD width is picked here, not at compile time).
#pragma once

#include "core/common.h"

namespace comm {

// out[i] = a[i] op b[i]; out may alias a or b exactly (in place), never partially.
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);
// out[i] = in[i] * factor, floating dtypes only (PREMUL_SUM inputs, AVG results).
using ScaleFn = void (*)(void* out, const void* in, size_t n, double factor);

// AVG and PREMUL_SUM reduce as SUM (the engine scales before / after). nullptr if the
// combination is not defined (comm.core.types.op_allowed refuses those earlier).
ReduceFn reduce_fn(DType t, ReduceOp op);
ScaleFn scale_fn(DType t);
// The instruction set the kernels run with here: "avx512", "avx2" or "baseline".
const char* kernel_isa();

}  // namespace comm
