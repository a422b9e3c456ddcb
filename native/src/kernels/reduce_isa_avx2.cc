// The reduction kernels built for the avx2 instruction set (flags set in CMakeLists.txt).
#define KERNEL_NS avx2
#include "kernels/reduce_kernels.inc"
