// The reduction kernels built for the avx512 instruction set (flags set in CMakeLists.txt).
#define KERNEL_NS avx512
#include "kernels/reduce_kernels.inc"
