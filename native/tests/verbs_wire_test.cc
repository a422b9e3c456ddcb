// The device-free parts of the verbs channel (verbs_wire.h): immediates, credit accounting,
// the stream in slots (header checks, drained payloads, a header read apart from its body),
// the address record, the RDMA READ depth, GID choice. Built (linking the engine library, which
// needs no rdma-core headers for this part) and run by tests/test_verbs.py; exits non-zero
// naming the first failed check.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <stdexcept>

#include "check.h"
#include "channels/verbs/verbs_wire.h"

using namespace comm::verbs;

static void immediates() {
  for (Imm imm : {Imm{Kind::DATA, 0, 1}, Imm{Kind::DATA, kMaxCredits, 65536}, Imm{Kind::CREDIT, 64, 0}}) {
    Imm back;
    CHECK(decode_imm(encode_imm(imm), 65536, &back));
    CHECK(back.kind == imm.kind && back.credits == imm.credits && back.bytes == imm.bytes);
  }
  CHECK(encode_imm({Kind::DATA, 3, 5}) >> 30 == 1);  // the kind is in the top bits
  CHECK(throws<std::invalid_argument>([] { encode_imm({Kind::DATA, kMaxCredits + 1, 1}); }));
  CHECK(throws<std::invalid_argument>([] { encode_imm({Kind::DATA, 0, kMaxSlotBytes + 1}); }));
  Imm out;
  CHECK(!decode_imm(5, 65536, &out));                                      // no kind
  CHECK(!decode_imm(3u << 30, 65536, &out));                               // kind 3 is none
  CHECK(!decode_imm(encode_imm({Kind::DATA, 0, 0}), 65536, &out));         // an empty slot
  CHECK(!decode_imm(encode_imm({Kind::DATA, 0, 65537}), 65536, &out));     // past the slot
  CHECK(!decode_imm(encode_imm({Kind::CREDIT, 1, 0}) | 7, 65536, &out));  // CREDIT carries no bytes
}

static void credits() {
  CreditWindow w(4);
  int taken = 0;
  for (int i = 0; i < 6; i++) taken += w.try_take();
  CHECK(taken == 4 && w.available() == 0);  // exhaustion blocks, never negative
  CHECK(w.restore(3) && w.available() == 3);
  CHECK(!w.restore(2));                      // more than were ever spent
  CHECK(throws<std::invalid_argument>([] { CreditWindow(0); }));
  CHECK(throws<std::invalid_argument>([] { CreditWindow(kMaxCredits + 1); }));

  CreditWindow r(8);
  for (int i = 0; i < 3; i++) CHECK(r.processed());
  CHECK(!r.needs_explicit_return());
  CHECK(r.processed() && r.needs_explicit_return());  // half the window is owed
  CHECK(r.to_return() == 4 && r.owed() == 0);
  for (int i = 0; i < 8; i++) CHECK(r.processed());
  CHECK(!r.processed());                               // the peer ignored flow control
  CHECK(CreditWindow(1).needs_explicit_return() == false);
  CreditWindow one(1);
  CHECK(one.processed() && one.needs_explicit_return());
  CHECK(kCreditReserve >= 2);                          // at most two unread CREDIT messages
}

static Address sample(int ranks, uint32_t streams) {
  Address a;
  a.port = 1;
  a.mtu = 5;
  a.lid = 7;
  a.gid_index = 3;
  a.rd_atomic = 8;
  for (int i = 0; i < 16; i++) a.gid[i] = static_cast<uint8_t>(0xf0 + i);
  a.slots = 16;
  a.slot_bytes = 128 << 10;
  a.streams = streams;
  for (int i = 0; i < ranks * static_cast<int>(streams); i++)
    a.entries.push_back({0x100u + i, 0xabc00u + i, 0x7f0000001000ull + i * 4096ull, 0xbeefu});
  return a;
}

static void address() {
  const Address a = sample(3, 2);
  const std::string data = encode_address(a);
  Address b;
  std::string why;
  CHECK(decode_address(data, 3, 2, &b, &why));
  CHECK(b.port == 1 && b.mtu == 5 && b.lid == 7 && b.gid_index == 3 && b.slots == 16 && b.slot_bytes == (128 << 10));
  CHECK(b.gid[15] == 0xff && b.entries.size() == 6 && b.rd_atomic == 8);
  for (size_t i = 0; i < 6; i++)
    CHECK(b.entries[i].qpn == a.entries[i].qpn && b.entries[i].psn == a.entries[i].psn &&
          b.entries[i].ring_addr == a.entries[i].ring_addr && b.entries[i].ring_rkey == a.entries[i].ring_rkey);
  // truncated, extended, foreign, for another group size or stream count
  for (size_t cut : {size_t{0}, size_t{1}, size_t{10}, size_t{47}, size_t{48}, data.size() - 1})
    CHECK(!decode_address(data.substr(0, cut), 3, 2, &b, &why));
  CHECK(!decode_address(data + '\0', 3, 2, &b, &why));
  CHECK(!decode_address("XXXX" + data.substr(4), 3, 2, &b, &why) && why.find("version") != std::string::npos);
  CHECK(!decode_address(data, 4, 2, &b, &why) && why.find("expected") != std::string::npos);
  CHECK(!decode_address(data, 3, 1, &b, &why));
  std::string bad = data;
  bad[7] = 9;  // mtu code outside enum ibv_mtu
  CHECK(!decode_address(bad, 3, 2, &b, &why) && why.find("out of range") != std::string::npos);
  for (uint8_t rd : {uint8_t{0}, uint8_t{kMaxRdAtomic + 1}}) {  // no READ served, or past the cap
    Address odd = sample(3, 2);
    odd.rd_atomic = rd;
    CHECK(!decode_address(encode_address(odd), 3, 2, &b, &why) && why.find("rd atomic") != std::string::npos);
  }
  Address wide = sample(3, 2);
  wide.entries[4].qpn = 1u << 24;
  CHECK(!decode_address(encode_address(wide), 3, 2, &b, &why) && why.find("24 bits") != std::string::npos);
  std::string garbage(data.size(), '\0');
  for (size_t i = 0; i < garbage.size(); i++) garbage[i] = static_cast<char>((i * 2654435761u) >> 13);
  CHECK(!decode_address(garbage, 3, 2, &b, &why));
}

// READs in flight never exceed what the peer serves, nor the device, nor the cap; at least 1.
static void read_depth() {
  CHECK(responder_resources(16) == 16 && responder_resources(4) == 4);
  CHECK(responder_resources(255) == kMaxRdAtomic && responder_resources(0) == 1 && responder_resources(-1) == 1);
  CHECK(initiator_depth(16, 4) == 4);              // the peer serves fewer than we could issue
  CHECK(initiator_depth(2, 16) == 2);              // our device issues fewer than the peer serves
  CHECK(initiator_depth(255, 255) == kMaxRdAtomic);
  CHECK(initiator_depth(0, 8) == 1 && initiator_depth(8, 0) == 1);
  for (int mine = 0; mine < 40; mine++)
    for (int theirs = 1; theirs <= static_cast<int>(kMaxRdAtomic); theirs++) {
      const int d = initiator_depth(mine, static_cast<uint8_t>(theirs));
      CHECK(d >= 1 && d <= theirs && (mine < 1 || d <= mine));
    }
}

static GidEntry gid(int index, bool zero, bool v4_mapped, int type) {
  GidEntry e{index, {}, type};
  if (zero) return e;
  if (v4_mapped) {
    e.gid[10] = e.gid[11] = 0xff;
    e.gid[12] = 198;
    e.gid[13] = 18;
    e.gid[15] = 1;
  } else {
    e.gid[0] = 0xfe;
    e.gid[1] = 0x80;
    e.gid[15] = 1;
  }
  return e;
}

static void gid_choice() {
  const int IB = 0, V1 = 1, V2 = 2;
  std::vector<GidEntry> table = {gid(0, false, false, V1), gid(1, false, false, V2), gid(2, false, true, V1),
                                 gid(3, false, true, V2)};
  CHECK(choose_gid(table, true, -1) == 1);  // the first non-zero RoCE v2 entry
  CHECK(choose_gid({table.begin() + 2, table.end()}, true, -1) == 3);
  CHECK(choose_gid({gid(0, false, false, V1), gid(5, true, false, V2)}, true, -1) == 0);  // zero GID never
  CHECK(choose_gid({gid(0, false, false, V1), gid(1, false, true, -1)}, true, -1) == 0);  // type unknown
  CHECK(choose_gid(table, true, 7) == 7);                                                // configured wins
  CHECK(choose_gid({gid(0, false, false, IB)}, false, -1) == 0);                         // InfiniBand: LID
}

// The verbs channel's send and receive paths without the NIC: a DATA write is a copy of the
// staging slot into ring slot k mod slots, its immediate encoded and decoded on the way; the
// receiver's emptied slots go back as credits. Same calls, same accounting as verbs.cc.
struct Pipe {
  const uint32_t slots, slot_bytes;
  std::vector<std::vector<char>> ring;
  std::vector<char> staging;
  CreditWindow writer, reader;
  std::deque<uint32_t> arrived;
  uint64_t written = 0, read_slot = 0;
  uint32_t read_off = 0, writes = 0;

  Pipe(uint32_t n, uint32_t bytes)
      : slots(n), slot_bytes(bytes), ring(n, std::vector<char>(bytes)), staging(bytes), writer(n), reader(n) {}

  bool send(comm::Transfer& t) {
    bool moved = false;
    while (!t.complete() && writer.try_take()) {
      const uint32_t n = fill_slot(t, staging.data(), slot_bytes);
      Imm imm;
      CHECK(n >= 1 && n <= slot_bytes && decode_imm(encode_imm({Kind::DATA, 0, n}), slot_bytes, &imm));
      std::memcpy(ring[written++ % slots].data(), staging.data(), imm.bytes);
      arrived.push_back(imm.bytes);
      writes++;
      moved = true;
    }
    return moved;
  }

  bool recv(comm::Transfer& t) {
    bool moved = false;
    while (!t.complete() && !arrived.empty()) {
      read_off += take_from_slot(t, ring[read_slot % slots].data() + read_off, arrived.front() - read_off, 1);
      moved = true;
      if (read_off == arrived.front()) {
        arrived.pop_front();
        read_slot++;
        read_off = 0;
        CHECK(reader.processed());
      }
    }
    if (reader.needs_explicit_return()) CHECK(writer.restore(reader.to_return()));  // a CREDIT message
    return moved;
  }

  // Both ends until both transfers complete; false if neither can move (a deadlock).
  bool run(comm::Transfer& s, comm::Transfer& r) {
    while (!s.complete() || !r.complete()) {
      bool moved = send(s);
      moved |= recv(r);
      if (!moved) return false;
    }
    return true;
  }
};

static comm::WireHeader header(uint64_t seq, uint64_t len) {
  comm::WireHeader h;
  h.kind = static_cast<uint8_t>(comm::OpKind::ALL_REDUCE);
  h.dtype = static_cast<uint8_t>(comm::DType::U8);
  h.seq = seq;
  h.count = len;
  h.len = len;
  return h;
}

static comm::Transfer transfer(bool is_send, std::vector<char>& buf, size_t len, const comm::WireHeader& h) {
  comm::Transfer t;
  t.is_send = is_send;
  t.buf = buf.data();
  t.len = len;
  t.hdr = h;
  return t;
}

static void stream() {
  Pipe pipe(4, 256);  // small slots and ring: messages span slots and need credits back
  uint64_t seq = 0;
  for (size_t len : {size_t{0}, size_t{1}, size_t{23}, size_t{216}, size_t{217}, size_t{256}, size_t{3 * 256 + 7},
                     size_t{40 * 256 + 3}}) {
    std::vector<char> out(len + 1), in(len + 1, 0);
    for (size_t i = 0; i < len; i++) out[i] = static_cast<char>(i * 7 + len);
    comm::Transfer s = transfer(true, out, len, header(seq, len)), r = transfer(false, in, len, header(seq, len));
    seq++;
    CHECK(pipe.run(s, r));
    CHECK(std::memcmp(out.data(), in.data(), len) == 0 && in[len] == 0);  // nothing past the end
    CHECK(r.got.seq == s.hdr.seq && r.got.len == len);
  }
  CHECK(pipe.arrived.empty() && pipe.read_off == 0);

  // Different operations: MISMATCH once the header is in, before a payload byte lands.
  {
    std::vector<char> out(600, 'x'), in(600, 'u');
    comm::Transfer s = transfer(true, out, 600, header(seq, 600)), r = transfer(false, in, 600, header(seq + 1, 600));
    bool threw = false;
    try {
      pipe.run(s, r);
    } catch (const comm::CommError& e) {
      threw = e.code == comm::ErrorCode::MISMATCH && e.peer == 1;
    }
    CHECK(threw && in == std::vector<char>(600, 'u'));
  }

  // all_to_all splits that disagree: the payload is drained unread, both transfers complete.
  {
    Pipe p(4, 256);
    std::vector<char> out(700, 'y'), in(100, 'u');
    comm::Transfer s = transfer(true, out, 700, header(5, 700)), r = transfer(false, in, 100, header(5, 100));
    r.check = comm::Transfer::Check::SPLITS;
    CHECK(p.run(s, r));
    CHECK(r.drain && r.len == 700 && r.got.len == 700 && in == std::vector<char>(100, 'u'));
    CHECK(p.arrived.empty());
  }

  // Send / recv: the header is read alone (its receiver is chosen from it), the body later.
  {
    Pipe p(4, 256);
    std::vector<char> out(500), in(500), none;
    for (size_t i = 0; i < out.size(); i++) out[i] = static_cast<char>(i);
    comm::WireHeader h = header(9, 500);
    comm::Transfer s = transfer(true, out, 500, h), head = transfer(false, none, 0, comm::WireHeader{});
    head.buf = nullptr;
    head.check = comm::Transfer::Check::NONE;
    p.send(s);
    CHECK(p.recv(head) && head.complete() && head.got.len == 500 && head.got.seq == 9);
    comm::Transfer body = transfer(false, in, head.got.len, comm::WireHeader{});
    body.with_header = false;
    CHECK(p.run(s, body) && in == out);
  }
}

int main() {
  immediates();
  credits();
  stream();
  address();
  read_depth();
  gid_choice();
  std::puts("verbs_wire: all checks passed");
  return 0;
}
