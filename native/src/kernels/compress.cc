// Picks the compressed wire formats' kernels for this CPU: the instruction set the reduction
// kernels chose (reduce.cc), so one detection decides both.
#include "kernels/compress.h"

#include <cstring>

#include "kernels/reduce.h"

namespace comm::compress {
namespace baseline { extern const Kernels table; }
#if defined(__x86_64__) || defined(_M_X64)
namespace avx2 { extern const Kernels table; }
namespace avx512 { extern const Kernels table; }
#endif

const Kernels& kernels() {
#if defined(__x86_64__) || defined(_M_X64)
  static const Kernels& chosen = std::strcmp(kernel_isa(), "avx512") == 0 ? avx512::table
                                 : std::strcmp(kernel_isa(), "avx2") == 0 ? avx2::table
                                                                          : baseline::table;
  return chosen;
#else
  return baseline::table;
#endif
}

}  // namespace comm::compress
