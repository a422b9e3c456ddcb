// all_to_all with every rank on one host. One slot round first: each rank publishes its
// splits (what it sends to and expects from every rank), the address of its input, and its
// whole input too when that fits the slot. Every rank then sees every rank's splits, so
// every rank makes the same choice (and a pair of ranks that disagree on their splits fails
// with Mismatch on both, after every other block arrived, as in the pairwise exchange):
//   - every input was published: copy this rank's blocks out of the slots (one round, one
//     copy in and one out; small messages);
//   - else, where process_vm_readv is allowed: read this rank's blocks straight out of the
//     peers' inputs (one copy), then one round so nobody returns while being read;
//   - else the pairwise exchange over the channels.
// The reads are the choice that is never slow: the pairwise exchange through the rings leads
// while both ranks' cores share their caches, and falls to a quarter of its speed where they
// do not (see native/TUNING.md, "all_to_all on one host").
#include <cstring>

#include "algorithms/algorithms.h"

namespace comm {

namespace {

constexpr uint64_t kNotPublished = ~uint64_t{0};

struct Layout {
  int n;
  size_t splits_bytes() const { return (2 * n * sizeof(uint64_t) + 63) & ~size_t{63}; }
};

const uint64_t* sends_of(const Comm& c, int p, uint64_t round) {
  return reinterpret_cast<const uint64_t*>(c.shm->slot_data(p, round));
}
const uint64_t* expects_of(const Comm& c, int p, uint64_t round) { return sends_of(c, p, round) + c.size; }

// Whether this rank and `p` agree on the splits between them; else `got` / `want` are the
// headers fail_splits names them with (as the pairwise exchange would have received them).
bool agree(const Comm& c, const Coll& op, uint64_t round, int p, WireHeader& got, WireHeader& want) {
  const int me = c.rank;
  const uint64_t they_send = sends_of(c, p, round)[me], i_expect = expects_of(c, me, round)[p];
  const uint64_t i_send = sends_of(c, me, round)[p], they_expect = expects_of(c, p, round)[me];
  got = op.header(they_send * op.elem);
  want = op.header(i_expect * op.elem);
  got.count = they_expect * op.elem;
  want.count = i_send * op.elem;
  return they_send == i_expect && i_send == they_expect;
}

size_t offset_in(const uint64_t* splits, int upto, size_t elem) {
  size_t off = 0;
  for (int q = 0; q < upto; q++) off += splits[q];
  return off * elem;
}

void local_all_to_all(Comm& c, const Coll& op, bool may_copy) {
  const int n = c.size, me = c.rank;
  const Layout lay{n};
  const std::vector<uint64_t>& sends = *op.send_counts;
  const std::vector<uint64_t>& expects = *op.recv_counts;
  size_t in_bytes = 0;
  for (uint64_t k : sends) in_bytes += k * op.elem;
  const uint64_t round = c.begin_round();
  Slot* mine = c.shm->slot(me, round);
  const bool publish = may_copy && lay.splits_bytes() + in_bytes <= kSlotBytes;
  mine->hdr = op.header(publish ? in_bytes : kNotPublished);
  mine->send_addr = reinterpret_cast<uint64_t>(op.send);
  std::memcpy(c.shm->slot_data(me, round), sends.data(), n * sizeof(uint64_t));
  std::memcpy(c.shm->slot_data(me, round) + n * sizeof(uint64_t), expects.data(), n * sizeof(uint64_t));
  if (publish && in_bytes) std::memcpy(c.shm->slot_data(me, round) + lay.splits_bytes(), op.send, in_bytes);
  c.publish_round(round);
  c.wait_round(round);
  bool all_published = true;
  for (int p = 0; p < n; p++) {
    WireHeader theirs = c.shm->slot(p, round)->hdr;
    if (p != me) {
      WireHeader want = mine->hdr;
      want.len = theirs.len;  // the lengths differ by design: the splits are checked next
      check_header(theirs, want, p);
    }
    all_published &= theirs.len != kNotPublished;
  }
  // A pair that disagrees fails on both its ranks, after this rank's other blocks arrived
  // (and its part of the last round ran), so no other rank waits or misses a block.
  int disagrees = -1;
  WireHeader got, want;
  for (int p = 0; p < n && disagrees < 0; p++)
    if (p != me && !agree(c, op, round, p, got, want)) disagrees = p;
  auto ok = [&](int p) { return p != me && p != disagrees && expects[p]; };
  const size_t my_in = offset_in(sends.data(), me, op.elem), my_out = offset_in(expects.data(), me, op.elem);
  if (sends[me]) std::memmove(op.recv + my_out, op.send + my_in, sends[me] * op.elem);
  if (all_published) {
    for (int p = 0; p < n; p++)
      if (ok(p))
        std::memcpy(op.recv + offset_in(expects.data(), p, op.elem),
                    c.shm->slot_data(p, round) + lay.splits_bytes() + offset_in(sends_of(c, p, round), me, op.elem),
                    expects[p] * op.elem);
    // The slot of this round is overwritten only after every rank reached the next.
  } else if (c.cma) {
    for (int p = 0; p < n; p++)
      if (ok(p))
        read_peer(c, p, c.shm->slot(p, round)->send_addr + offset_in(sends_of(c, p, round), me, op.elem),
                  op.recv + offset_in(expects.data(), p, op.elem), expects[p] * op.elem);
    sync_round(c);  // nobody returns (and lets the caller reuse its input) while being read
  } else {
    return pairwise_all_to_all(c, op);  // checks the splits on its own messages
  }
  if (disagrees >= 0) fail_splits(got, want, disagrees);
}

}  // namespace

bool all_local(const Comm& c, const Coll&) { return c.all_local(); }

void direct_all_to_all(Comm& c, const Coll& op) { local_all_to_all(c, op, true); }

void cma_all_to_all(Comm& c, const Coll& op) { local_all_to_all(c, op, false); }

}  // namespace comm
