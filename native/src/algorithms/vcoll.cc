// v-collectives (all_gather_v, reduce_scatter_v): blocks of any size, counts[r] elements for
// rank r, alike on every rank. The ring and cma schedules are the even ones over other block
// sizes (ring.cc, cma.cc); here: the check that every rank passed the same counts, and the
// direct (shared-memory slot) forms for small payloads.
#include <cstring>

#include "algorithms/algorithms.h"
#include "core/topology.h"

namespace comm {

namespace {

std::string show(const std::vector<uint64_t>& counts) {
  constexpr size_t kShown = 16;  // a group of thousands would drown the message
  std::string s = "[";
  for (size_t i = 0; i < counts.size() && i < kShown; i++) s += (i ? ", " : "") + std::to_string(counts[i]);
  if (counts.size() > kShown) s += ", ... (" + std::to_string(counts.size()) + " entries)";
  return s + "]";
}

[[noreturn]] void counts_disagree(const Comm& c, const Coll& op, int peer, const std::vector<uint64_t>& theirs) {
  fail(ErrorCode::MISMATCH, peer,
       std::string(kind_name(op.kind)) + " counts disagree: rank " + std::to_string(peer) + " passed counts " +
           show(theirs) + ", rank " + std::to_string(c.rank) + " passed " + show(*op.recv_counts) +
           " (every rank must pass the same counts)");
}

std::vector<uint64_t> counts_at(const char* p, int n) {
  std::vector<uint64_t> v(n);
  std::memcpy(v.data(), p, n * sizeof(uint64_t));
  return v;
}

// Where a v-collective's payload starts in a slot's data (after the counts).
char* payload(const Comm& c, int p, uint64_t round) { return c.shm->slot_data(p, round) + counts_area(c); }

}  // namespace

uint64_t counts_fingerprint(const std::vector<uint64_t>& counts) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the counts' bytes
  for (uint64_t k : counts)
    for (int i = 0; i < 8; i++) h = (h ^ ((k >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

size_t counts_area(const Comm& c) { return (c.size * sizeof(uint64_t) + 63) & ~size_t{63}; }

void publish_counts(const Comm& c, const Coll& op, uint64_t round) {
  Slot* mine = c.shm->slot(c.shm->me(), round);
  mine->hdr = op.header(0);
  std::memcpy(c.shm->slot_data(c.shm->me(), round), op.recv_counts->data(), c.size * sizeof(uint64_t));
}

void check_counts(const Comm& c, const Coll& op, uint64_t round, int p) {
  const WireHeader& theirs = c.shm->slot(p, round)->hdr;
  const WireHeader& mine = c.shm->slot(c.shm->me(), round)->hdr;
  if (theirs.magic == kWireMagic && theirs.kind == mine.kind && theirs.count != mine.count)
    counts_disagree(c, op, c.shm->global(p), counts_at(c.shm->slot_data(p, round), c.size));
  check_header(theirs, mine, c.shm->global(p));
}

void agree_on_counts(Comm& c, const Coll& op) {
  if (c.all_local()) {  // one flag round: every rank sees every rank's counts
    const uint64_t round = c.begin_round();
    publish_counts(c, op, round);
    c.publish_round(round);
    c.wait_round(round);
    for (int p = 0; p < c.size; p++)
      if (p != c.rank) check_counts(c, op, round, p);
    return;
  }
  // Across hosts: each rank checks its ring predecessor's counts (so a pair that disagrees
  // fails there; with more than two ranks, the others then wait for them until the timeout).
  const int next = mod(c.rank + 1, c.size), prev = mod(c.rank - 1, c.size);
  const size_t bytes = c.size * sizeof(uint64_t);
  std::vector<uint64_t> theirs(c.size);
  Transfer ts[2] = {c.send_to(next, op.recv_counts->data(), bytes, op.header(0)),
                    c.recv_from(prev, theirs.data(), bytes, op.header(0))};
  ts[1].check = Transfer::Check::SPLITS;  // the fingerprint in `count` may differ: compared here
  c.run(ts, 2);
  if (ts[1].got.len != bytes) fail_splits(ts[1].got, ts[1].hdr, prev);  // not this group's size
  if (ts[1].got.count != ts[1].hdr.count) counts_disagree(c, op, prev, theirs);
}

bool direct_v_fits(const Comm& c, const Coll& op) {
  if (!c.all_local()) return false;
  const CountedBlocks b{*op.recv_counts};
  // Alike on every rank: the largest block, not this rank's own.
  const size_t bytes = (op.kind == OpKind::ALL_GATHER_V ? b.largest() : b.offset(c.size)) * op.elem;
  return counts_area(c) + bytes <= kSlotBytes;
}

void direct_all_gather_v(Comm& c, const Coll& op) {
  const CountedBlocks b{*op.recv_counts};
  const uint64_t round = c.begin_round();
  publish_counts(c, op, round);
  const size_t mine = b.size(c.rank) * op.elem;
  if (mine) std::memcpy(payload(c, c.rank, round), op.send, mine);
  c.publish_round(round);
  c.wait_round(round);
  for (int p = 0; p < c.size; p++)
    if (p != c.rank) check_counts(c, op, round, p);
  for (int p = 0; p < c.size; p++) {
    char* dst = op.recv + b.offset(p) * op.elem;
    const char* src = p == c.rank ? op.send : payload(c, p, round);
    if (b.size(p) && src != dst) std::memcpy(dst, src, b.size(p) * op.elem);
  }
}

void direct_reduce_scatter_v(Comm& c, const Coll& op) {
  const CountedBlocks b{*op.recv_counts};
  const uint64_t round = c.begin_round();
  publish_counts(c, op, round);
  const size_t all = b.offset(c.size) * op.elem;
  if (all) std::memcpy(payload(c, c.rank, round), op.send, all);
  c.publish_round(round);
  c.wait_round(round);
  for (int p = 0; p < c.size; p++)
    if (p != c.rank) check_counts(c, op, round, p);
  if (b.size(c.rank))
    reduce_slots(c, op, round, counts_area(c) + b.offset(c.rank) * op.elem, op.recv, b.size(c.rank));
}

}  // namespace comm
