// Wire formats of compressed collectives (comm/compress.py): fp32 data to bf16, or to fp8
// e4m3 with one fp32 scale per block, and back, fused with the fp32 sum the receiver keeps.
// Chosen at run time for the CPU, as the reduction kernels are (reduce.h: kernel_isa).
#pragma once

#include <cstddef>
#include <cstdint>

namespace comm::compress {

// The fp8 format: e4m3 codes (sign, 4 exponent bits with bias 7, 3 mantissa bits). Finite
// values are scaled so that the block's largest magnitude maps to kFp8Max (240, the top of
// exponent 14): the codes of exponent 15 stay free for what the exact path would produce,
// 0x78 | sign for +-Inf and 0x7f for NaN, element by element. Subnormal codes (exponent 0)
// carry magnitudes below 2^-6 in steps of 2^-9.
constexpr float kFp8Max = 240.0f;

struct Kernels {
  // out[i] = bf16(in[i]), rounded to nearest even; NaN stays NaN (quiet), +-Inf stays +-Inf.
  void (*to_bf16)(const float* in, uint16_t* out, size_t n);
  // acc[i] = (accumulate ? acc[i] : 0) + float(in[i]).
  void (*bf16_add)(float* acc, const uint16_t* in, size_t n, bool accumulate);
  // codes[i] = e4m3(in[i] / scales[i / block]), scales[b] = (largest finite |in| of block b) / 240
  // (1 for a block without a finite non-zero value). The last block may be short.
  void (*to_fp8)(const float* in, uint8_t* codes, float* scales, size_t n, size_t block);
  // acc[i] = (accumulate ? acc[i] : 0) + value(codes[i]) * scales[i / block].
  void (*fp8_add)(float* acc, const uint8_t* codes, const float* scales, size_t n, size_t block,
                  bool accumulate);
};

// The kernels for this CPU (baseline, AVX2 or AVX-512 builds of compress_kernels.inc).
const Kernels& kernels();

}  // namespace comm::compress
