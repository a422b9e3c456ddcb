#include "channels/channel.h"

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
         ", root=" + std::to_string(h.root) + ", bytes=" + std::to_string(h.len) +
         (h.flags == static_cast<uint8_t>(Wire::BF16)  ? ", compress=bf16"
          : h.flags == static_cast<uint8_t>(Wire::FP8) ? ", compress=fp8"
          : h.flags                                    ? ", compress=?"
                                                       : "") +
         ")";
}

void check_header(const WireHeader& g, const WireHeader& e, int peer_, Transfer::Check check) {
  if (g.magic != kWireMagic)
    fail(ErrorCode::MISMATCH, peer_, "corrupt message header from rank " + std::to_string(peer_));
  if (check == Transfer::Check::NONE) return;
  if (g.kind != e.kind || g.dtype != e.dtype || g.op != e.op || g.flags != e.flags || g.seq != e.seq ||
      g.count != e.count || g.root != e.root || g.tag != e.tag || g.len != e.len)
    fail(ErrorCode::MISMATCH, peer_,
         "rank " + std::to_string(peer_) + " sent " + describe(g) + " but this rank expected " +
             describe(e) + ": the ranks called different operations");
}

void accept_header(Transfer& t, int peer) {
  if (t.check != Transfer::Check::SPLITS) return check_header(t.got, t.hdr, peer, t.check);
  WireHeader lengths_aside = t.got;
  lengths_aside.len = t.hdr.len;
  lengths_aside.count = t.hdr.count;
  check_header(lengths_aside, t.hdr, peer);
  if (t.got.len != t.hdr.len) {
    t.drain = true;
    t.len = t.got.len;
  }
}

void fail_splits(const WireHeader& got, const WireHeader& expected, int peer) {
  const size_t elem = itemsize(static_cast<DType>(expected.dtype));
  auto elems = [&](uint64_t bytes) { return std::to_string(bytes / elem); };
  const std::string them = "rank " + std::to_string(peer);
  fail(ErrorCode::MISMATCH, peer,
       "all_to_all splits disagree: " + them + " sends " + elems(got.len) +
           " elements to this rank, which expects " + elems(expected.len) + "; this rank sends " +
           elems(expected.count) + " elements to " + them + ", which expects " + elems(got.count) +
           " (in_splits[j] on rank i must equal out_splits[i] on rank j)");
}

}  // namespace comm
