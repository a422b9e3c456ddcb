// The reduction kernels built for the baseline instruction set (flags set in CMakeLists.txt).
#define KERNEL_NS baseline
#include "kernels/reduce_kernels.inc"
