#include "channels/verbs/verbs_wire.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace comm::verbs {

uint32_t encode_imm(const Imm& imm) {
  if (imm.credits > kMaxCredits || imm.bytes > kMaxSlotBytes)
    throw std::invalid_argument("verbs immediate field out of range");
  return (static_cast<uint32_t>(imm.kind) << 30) | (imm.credits << 23) | imm.bytes;
}

bool decode_imm(uint32_t word, uint32_t slot_bytes, Imm* out) {
  const uint32_t kind = word >> 30;
  if (kind != static_cast<uint32_t>(Kind::DATA) && kind != static_cast<uint32_t>(Kind::CREDIT)) return false;
  out->kind = static_cast<Kind>(kind);
  out->credits = (word >> 23) & kMaxCredits;
  out->bytes = word & kMaxSlotBytes;
  if (out->kind == Kind::DATA) return out->bytes >= 1 && out->bytes <= slot_bytes;
  return out->bytes == 0;
}

uint32_t fill_slot(Transfer& t, char* slot, uint32_t slot_bytes) {
  uint32_t n = 0;
  if (!t.header_complete()) {
    n = static_cast<uint32_t>(sizeof(WireHeader) - t.hdr_done);  // slots hold at least 64 bytes
    std::memcpy(slot, reinterpret_cast<const char*>(&t.hdr) + t.hdr_done, n);
    t.hdr_done += n;
  }
  const size_t body = std::min<size_t>(t.len - t.done, slot_bytes - n);
  if (body) std::memcpy(slot + n, t.buf + t.done, body);
  t.done += body;
  return n + static_cast<uint32_t>(body);
}

uint32_t take_from_slot(Transfer& t, const char* src, uint32_t avail, int peer) {
  uint32_t used = 0;
  while (used < avail && !t.complete()) {
    uint32_t n;
    if (!t.header_complete()) {
      n = std::min<uint32_t>(avail - used, static_cast<uint32_t>(sizeof(WireHeader) - t.hdr_done));
      std::memcpy(reinterpret_cast<char*>(&t.got) + t.hdr_done, src + used, n);
      t.hdr_done += n;
      if (t.header_complete()) accept_header(t, peer);
    } else {
      n = static_cast<uint32_t>(std::min<size_t>(avail - used, t.len - t.done));
      if (!t.drain) std::memcpy(t.buf + t.done, src + used, n);
      t.done += n;
    }
    used += n;
  }
  return used;
}

CreditWindow::CreditWindow(uint32_t limit) : limit_(limit), available_(limit) {
  if (limit < 1 || limit > kMaxCredits) throw std::invalid_argument("credit window outside 1..127");
}

bool CreditWindow::try_take() {
  if (available_ == 0) return false;
  available_--;
  return true;
}

bool CreditWindow::restore(uint32_t n) {
  if (available_ + n > limit_) return false;  // more than were ever spent: broken accounting
  available_ += n;
  return true;
}

bool CreditWindow::processed() {
  if (owed_ >= limit_) return false;  // the peer wrote more slots than it had credits for
  owed_++;
  return true;
}

uint32_t CreditWindow::to_return() {
  const uint32_t n = owed_;
  owed_ = 0;
  return n;
}

// ---- address record ------------------------------------------------------------------------
namespace {
constexpr char kMagic[4] = {'C', 'V', 'B', '3'};
constexpr uint16_t kVersion = 3;
// magic, version, port, mtu, lid, gid index, rd atomic, slots, slot bytes, streams, ranks, gid
constexpr size_t kHeaderBytes = 4 + 2 + 1 + 1 + 2 + 1 + 1 + 4 + 4 + 4 + 4 + 16;
constexpr size_t kEntryBytes = 4 + 4 + 8 + 4;

struct Writer {
  std::string out;
  void put(uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; i--) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void raw(const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
};

struct Reader {
  const unsigned char* p;
  uint64_t get(int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++) v = (v << 8) | *p++;
    return v;
  }
};
}  // namespace

std::string encode_address(const Address& a) {
  Writer w;
  w.raw(kMagic, 4);
  w.put(kVersion, 2);
  w.put(a.port, 1);
  w.put(a.mtu, 1);
  w.put(a.lid, 2);
  w.put(a.gid_index, 1);
  w.put(a.rd_atomic, 1);
  w.put(a.slots, 4);
  w.put(a.slot_bytes, 4);
  w.put(a.streams, 4);
  w.put(a.streams ? a.entries.size() / a.streams : 0, 4);
  w.raw(a.gid, 16);
  for (const QpEntry& e : a.entries) {
    w.put(e.qpn, 4);
    w.put(e.psn, 4);
    w.put(e.ring_addr, 8);
    w.put(e.ring_rkey, 4);
  }
  return w.out;
}

bool decode_address(const std::string& data, int ranks, uint32_t streams, Address* out, std::string* why) {
  if (data.size() < kHeaderBytes) {
    *why = "address record of " + std::to_string(data.size()) + " bytes is shorter than its header";
    return false;
  }
  Reader r{reinterpret_cast<const unsigned char*>(data.data())};
  if (std::memcmp(r.p, kMagic, 4) != 0 || (r.p += 4, r.get(2)) != kVersion) {
    *why = "not a verbs address record of this version (another library or version?)";
    return false;
  }
  Address a;
  a.port = static_cast<uint8_t>(r.get(1));
  a.mtu = static_cast<uint8_t>(r.get(1));
  a.lid = static_cast<uint16_t>(r.get(2));
  a.gid_index = static_cast<uint8_t>(r.get(1));
  a.rd_atomic = static_cast<uint8_t>(r.get(1));
  a.slots = static_cast<uint32_t>(r.get(4));
  a.slot_bytes = static_cast<uint32_t>(r.get(4));
  a.streams = static_cast<uint32_t>(r.get(4));
  const uint64_t n = r.get(4);
  std::memcpy(a.gid, r.p, 16);
  r.p += 16;
  const uint64_t want = kHeaderBytes + static_cast<uint64_t>(ranks) * streams * kEntryBytes;
  if (n != static_cast<uint64_t>(ranks) || a.streams != streams || data.size() != want) {
    *why = "address record has " + std::to_string(data.size()) + " bytes for " + std::to_string(n) +
           " ranks and " + std::to_string(a.streams) + " streams; expected " + std::to_string(want) +
           " for " + std::to_string(ranks) + " and " + std::to_string(streams);
    return false;
  }
  if (a.mtu < 1 || a.mtu > 5 || a.port == 0 || a.slots < 1 || a.slots > kMaxCredits || a.slot_bytes < 64 ||
      a.slot_bytes > kMaxSlotBytes || a.rd_atomic < 1 || a.rd_atomic > kMaxRdAtomic) {
    *why = "address record out of range (mtu code " + std::to_string(a.mtu) + ", rd atomic " +
           std::to_string(a.rd_atomic) + ", port " +
           std::to_string(a.port) + ", " + std::to_string(a.slots) + " slots of " +
           std::to_string(a.slot_bytes) + " bytes)";
    return false;
  }
  a.entries.resize(static_cast<size_t>(ranks) * streams);
  for (QpEntry& e : a.entries) {
    e.qpn = static_cast<uint32_t>(r.get(4));
    e.psn = static_cast<uint32_t>(r.get(4));
    e.ring_addr = r.get(8);
    e.ring_rkey = static_cast<uint32_t>(r.get(4));
    if (e.qpn >= (1u << 24) || e.psn >= (1u << 24)) {
      *why = "QP number or PSN wider than 24 bits";
      return false;
    }
  }
  *out = std::move(a);
  return true;
}

uint8_t responder_resources(int device_max_qp_rd_atom) {
  return static_cast<uint8_t>(std::clamp<int>(device_max_qp_rd_atom, 1, kMaxRdAtomic));
}

uint8_t initiator_depth(int device_max_qp_init_rd_atom, uint8_t peer_responder_resources) {
  return static_cast<uint8_t>(
      std::clamp<int>(std::min<int>(device_max_qp_init_rd_atom, peer_responder_resources), 1, kMaxRdAtomic));
}

int choose_gid(const std::vector<GidEntry>& table, bool ethernet, int wanted) {
  if (wanted >= 0) return wanted;
  if (ethernet)
    for (const GidEntry& e : table) {
      bool zero = true;
      for (uint8_t b : e.gid) zero = zero && b == 0;
      if (!zero && e.type == kGidTypeRoceV2) return e.index;
    }
  return 0;
}

}  // namespace comm::verbs
