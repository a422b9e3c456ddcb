#include "channel.h"

#include <string>

namespace comm {

static std::string describe(const WireHeader& h) {
  return std::string(h.kind < static_cast<int>(OpKind::COUNT) ? kind_name(static_cast<OpKind>(h.kind)) : "?") +
         "(seq=" + std::to_string(h.seq) + ", dtype=" + std::to_string(h.dtype) +
         ", op=" + std::to_string(h.op) + ", count=" + std::to_string(h.count) +
         ", root=" + std::to_string(h.root) + ", bytes=" + std::to_string(h.len) + ")";
}

void check_header(const WireHeader& g, const WireHeader& e, int peer_, Transfer::Check check) {
  if (g.magic != kWireMagic)
    fail(ErrorCode::MISMATCH, peer_, "corrupt message header from rank " + std::to_string(peer_));
  if (check == Transfer::Check::NONE) return;
  if (g.kind != e.kind || g.dtype != e.dtype || g.op != e.op || g.seq != e.seq ||
      g.count != e.count || g.root != e.root || g.tag != e.tag || g.len != e.len)
    fail(ErrorCode::MISMATCH, peer_,
         "rank " + std::to_string(peer_) + " sent " + describe(g) + " but this rank expected " +
             describe(e) + ": the ranks called different operations");
}

}  // namespace comm
