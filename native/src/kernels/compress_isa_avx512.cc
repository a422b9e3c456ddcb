// The compressed wire formats' kernels built for the avx512 instruction set (flags in CMakeLists.txt).
#define KERNEL_NS avx512
#include "kernels/compress_kernels.inc"
