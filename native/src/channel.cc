#include "channel.h"

#include <string>

namespace comm {

// Names as the user wrote them (Python's DType / ReduceOp); the header is checked before use,
// so out-of-range codes from a corrupt or hostile peer print as numbers.
static std::string code_name(unsigned v, const char* const* names, unsigned n) {
  return v < n ? names[v] : std::to_string(v);
}

static std::string describe(const WireHeader& h) {
  static const char* const dtypes[] = {"float16", "bfloat16", "float32", "float64", "int8",
                                       "int16", "int32", "int64", "uint8", "bool"};
  static const char* const ops[] = {"SUM", "PRODUCT", "MIN", "MAX", "AVG",
                                    "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  return std::string(h.kind < static_cast<int>(OpKind::COUNT) ? kind_name(static_cast<OpKind>(h.kind)) : "?") +
         "(seq=" + std::to_string(h.seq) + ", dtype=" + code_name(h.dtype, dtypes, 10) +
         ", op=" + code_name(h.op, ops, 9) + ", count=" + std::to_string(h.count) +
         ", root=" + std::to_string(h.root) + ", bytes=" + std::to_string(h.len) + ")";
}

void check_header(const WireHeader& g, const WireHeader& e, int peer_, Transfer::Check check) {
  if (g.magic != kWireMagic)
    fail(ErrorCode::MISMATCH, peer_, "corrupt message header from rank " + std::to_string(peer_));
  if (check == Transfer::Check::NONE) return;
  const bool same_op = g.kind == e.kind && g.dtype == e.dtype && g.op == e.op && g.seq == e.seq &&
                       g.root == e.root && g.tag == e.tag;
  if (same_op && g.kind == static_cast<uint8_t>(OpKind::ALL_TO_ALL) && (g.len != e.len || g.count != e.count)) {
    // all_to_all headers carry both directions between the two ranks (pairwise.cc).
    const size_t elem = e.dtype < static_cast<uint8_t>(DType::COUNT) ? itemsize(static_cast<DType>(e.dtype)) : 1;
    auto elems = [&](uint64_t bytes) { return std::to_string(bytes / elem); };
    const std::string me = "this rank", them = "rank " + std::to_string(peer_);
    fail(ErrorCode::MISMATCH, peer_,
         "all_to_all splits disagree: " + them + " sends " + elems(g.len) + " elements to " + me +
             ", which expects " + elems(e.len) + "; " + me + " sends " + elems(e.count) + " to " +
             them + ", which expects " + elems(g.count) +
             " (in_splits on one side must equal out_splits on the other)");
  }
  if (!same_op || g.count != e.count || g.len != e.len)
    fail(ErrorCode::MISMATCH, peer_,
         "rank " + std::to_string(peer_) + " sent " + describe(g) + " but this rank expected " +
             describe(e) + ": the ranks called different operations");
}

}  // namespace comm
