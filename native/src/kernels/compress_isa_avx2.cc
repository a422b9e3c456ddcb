// The compressed wire formats' kernels built for the avx2 instruction set (flags in CMakeLists.txt).
#define KERNEL_NS avx2
#include "kernels/compress_kernels.inc"
