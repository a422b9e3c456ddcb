// Run-time choice of the kernel set: the widest one this CPU supports.
#include "kernels/reduce.h"

namespace comm {
namespace kernels {
#define DECLARE_ISA(ns)                         \
  namespace ns {                                \
  ReduceFn reduce_table(DType t, ReduceOp op);  \
  ScaleFn scale_table(DType t);                 \
  }
DECLARE_ISA(baseline)
#if defined(__x86_64__)
DECLARE_ISA(avx2)
DECLARE_ISA(avx512)
#endif
#undef DECLARE_ISA
}  // namespace kernels

namespace {
enum class Isa { BASELINE, AVX2, AVX512 };

Isa detect() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return Isa::AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("fma"))
    return Isa::AVX2;
#endif
  return Isa::BASELINE;
}

const Isa isa = detect();
}  // namespace

ReduceFn reduce_fn(DType t, ReduceOp op) {
#if defined(__x86_64__)
  if (isa == Isa::AVX512) return kernels::avx512::reduce_table(t, op);
  if (isa == Isa::AVX2) return kernels::avx2::reduce_table(t, op);
#endif
  return kernels::baseline::reduce_table(t, op);
}

ScaleFn scale_fn(DType t) {
#if defined(__x86_64__)
  if (isa == Isa::AVX512) return kernels::avx512::scale_table(t);
  if (isa == Isa::AVX2) return kernels::avx2::scale_table(t);
#endif
  return kernels::baseline::scale_table(t);
}

const char* kernel_isa() {
  static const char* names[] = {"baseline", "avx2", "avx512"};
  return names[static_cast<int>(isa)];
}

}  // namespace comm
