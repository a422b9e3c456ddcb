// What the verbs channel puts on the wire and the accounting it keeps, as pure code (no
// libibverbs): built everywhere, so native/tests/verbs_wire_test.cc checks it on machines
// without an RDMA device or the rdma-core headers.
//
// Each verbs channel is one RC queue pair carrying a byte stream (header + payload, exactly
// what a TCP socket carries) in slots: the receiver owns a ring of `slots` slots of
// `slot_bytes` in registered memory; the sender fills a local registered copy of a slot and
// RDMA-WRITEs it WITH IMMEDIATE into slot (k mod slots) of the receiver's ring, k counting
// its data messages. The immediate says how many bytes the slot holds and returns credits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "channels/channel.h"

namespace comm::verbs {

// ---- immediates (host order here; the channel converts with htonl/ntohl) ----------------------
//   bits 31-30 kind     DATA (a slot was written) or CREDIT (only returns credits)
//   bits 29-23 credits  slots the writer has emptied in *its* ring since it last said so
//   bits 22-0  bytes    DATA: stream bytes in the slot (1..slot_bytes)
enum class Kind : uint32_t { DATA = 1, CREDIT = 2 };
constexpr uint32_t kMaxCredits = (1u << 7) - 1;   // also the most slots a ring may have
constexpr uint32_t kMaxSlotBytes = (1u << 23) - 1;

struct Imm {
  Kind kind;
  uint32_t credits;
  uint32_t bytes;
};
uint32_t encode_imm(const Imm& imm);  // throws std::invalid_argument when a field overflows
// False for a word with no valid kind, or a DATA word of 0 or more than slot_bytes bytes.
bool decode_imm(uint32_t word, uint32_t slot_bytes, Imm* out);

// ---- the stream in slots ------------------------------------------------------------------------
// Copies the next bytes of send `t` (its header first) into one slot: returns how many (the
// slot is full, or `t` is complete). A slot holds bytes of one transfer only.
uint32_t fill_slot(Transfer& t, char* slot, uint32_t slot_bytes);
// Moves up to `avail` received bytes at `src` into receive `t`: the header first, checked
// (accept_header, which throws MISMATCH) before a payload byte reaches the buffer; a drained
// payload is skipped. Returns how many were consumed (fewer once `t` is complete).
uint32_t take_from_slot(Transfer& t, const char* src, uint32_t avail, int peer);

// ---- credits ---------------------------------------------------------------------------------
// Every DATA message fills one receiver slot and consumes one receive request there: the
// sender spends a credit per message and gets it back in the immediates of the receiver's
// messages. CREDIT messages are not credited (credits that need credits could deadlock);
// at most two can be unread at once (each returns at least half of the window), so the
// receiver keeps kCreditReserve receive requests posted beyond the window.
constexpr uint32_t kCreditReserve = 4;

class CreditWindow {
 public:
  explicit CreditWindow(uint32_t limit);  // throws std::invalid_argument outside 1..kMaxCredits
  uint32_t limit() const { return limit_; }
  uint32_t available() const { return available_; }
  uint32_t owed() const { return owed_; }
  bool try_take();                 // spend one credit for a DATA message
  bool restore(uint32_t n);        // the peer returned n; false if that overflows the window
  bool processed();                // we emptied one of the peer's slots; false on an overrun
  uint32_t to_return();            // credits for the next outgoing immediate (cleared)
  bool needs_explicit_return() const { return owed_ >= (limit_ / 2 > 0 ? limit_ / 2 : 1); }

 private:
  uint32_t limit_, available_, owed_ = 0;
};

// ---- address record (exchanged once per communicator through the store) -----------------------
// A store value is untrusted bytes: fixed layout, network byte order, size-checked on decode.
struct QpEntry {
  uint32_t qpn = 0, psn = 0;
  uint64_t ring_addr = 0;  // the ring this rank's QP for that peer receives into
  uint32_t ring_rkey = 0;
};

struct Address {
  uint8_t port = 0, mtu = 0;  // mtu: enum ibv_mtu code, 1 (256 B) .. 5 (4096 B)
  uint16_t lid = 0;
  uint8_t gid_index = 0;
  uint8_t rd_atomic = 1;      // RDMA READs this rank serves at once per queue pair (1..kMaxRdAtomic)
  uint8_t gid[16] = {};       // zeros on plain InfiniBand without a GID
  uint32_t slots = 0, slot_bytes = 0;
  uint32_t streams = 0;       // queue pairs per peer (collective, send/recv)
  std::vector<QpEntry> entries;  // [peer * streams + stream]; zero for this rank itself
};

std::string encode_address(const Address& a);
// False (with *why set) unless `data` is a record of this version for a group of `ranks`
// with `streams` queue pairs per peer and fields in range.
bool decode_address(const std::string& data, int ranks, uint32_t streams, Address* out, std::string* why);

// ---- RDMA READ depth (windows' gets: window_verbs.cc) -------------------------------------------
// A queue pair's READs in flight (max_rd_atomic, the initiator depth) must not exceed what the
// peer's end serves at once (its max_dest_rd_atomic, the responder resources): a READ past
// them is a fatal "invalid request" for the pair. Each rank publishes its responder resources
// (its device's max_qp_rd_atom, clamped) and takes the smaller of theirs and its own
// max_qp_init_rd_atom. 1 is the floor (what every device supports, as before).
constexpr uint32_t kMaxRdAtomic = 16;
uint8_t responder_resources(int device_max_qp_rd_atom);
uint8_t initiator_depth(int device_max_qp_init_rd_atom, uint8_t peer_responder_resources);

// ---- GID choice (RoCE needs a GID; routers forward only RoCE v2) -------------------------------
struct GidEntry {
  int index;
  uint8_t gid[16];
  int type;  // enum ibv_gid_type: 0 IB, 1 RoCE v1, 2 RoCE v2; -1 unknown
};
constexpr int kGidTypeRoceV2 = 2;  // IBV_GID_TYPE_ROCE_V2 (what ibv_query_gid_ex reports)
// The configured index when wanted >= 0; on Ethernet the first non-zero RoCE v2 entry; else 0.
int choose_gid(const std::vector<GidEntry>& table, bool ethernet, int wanted);

}  // namespace comm::verbs
