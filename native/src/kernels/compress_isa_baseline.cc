// The compressed wire formats' kernels built for the baseline instruction set (flags in CMakeLists.txt).
#define KERNEL_NS baseline
#include "kernels/compress_kernels.inc"
