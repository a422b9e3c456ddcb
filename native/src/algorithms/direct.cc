// Direct shared-memory path for small payloads with every rank on one host: each rank
// copies its input into its slot, one round of flags says "published", then every rank
// reads the slots it needs and reduces locally. One flag round instead of log2(n) or
// 2(n-1) message steps. Slots alternate by round parity: a rank can only be one round
// ahead of the slowest reader, so the slot it overwrites has been read by everyone.
#include <cstring>

#include "algorithms/algorithms.h"

namespace comm {

namespace {

// Bytes each rank publishes for `op` (BROADCAST: only the root's are read).
size_t published_bytes(const Comm& c, const Coll& op) {
  switch (op.kind) {
    case OpKind::REDUCE_SCATTER: return op.count * c.size * op.elem;
    case OpKind::BARRIER: return 0;
    default: return op.count * op.elem;
  }
}

}  // namespace

void reduce_slots(const Comm& c, const Coll& op, uint64_t round, size_t offset, char* out, size_t n) {
  const ShmDomain& shm = *c.shm;
  if (c.size == 1) {
    std::memcpy(out, shm.slot_data(0, round) + offset, n * op.elem);
    return;
  }
  op.reduce(out, shm.slot_data(0, round) + offset, shm.slot_data(1, round) + offset, n);
  for (int p = 2; p < c.size; p++) op.reduce(out, out, shm.slot_data(p, round) + offset, n);
}

bool direct_fits(const Comm& c, const Coll& op) {
  return c.all_local() && published_bytes(c, op) <= kSlotBytes && op.kind != OpKind::SCATTER &&
         op.kind != OpKind::ALL_TO_ALL;
}

void direct_collective(Comm& c, const Coll& op) {
  const ShmDomain& shm = *c.shm;
  const int me = shm.me();  // == c.rank: all ranks are local and sorted
  const size_t bytes = published_bytes(c, op);
  const uint64_t round = c.begin_round();
  Slot* mine = shm.slot(me, round);
  mine->hdr = op.header(bytes);
  const bool publishes = op.kind != OpKind::BROADCAST || c.rank == op.root;
  if (publishes && bytes) std::memcpy(shm.slot_data(me, round), op.send, bytes);
  c.publish_round(round);
  c.wait_round(round);
  for (int p = 0; p < c.size; p++)
    if (p != me) check_header(shm.slot(p, round)->hdr, mine->hdr, p);

  const size_t block = op.count * op.elem;
  if (!block) return;  // nothing to read (and an empty array may have no address at all)
  switch (op.kind) {
    case OpKind::ALL_REDUCE: reduce_slots(c, op, round, 0, op.recv, op.count); break;
    case OpKind::REDUCE:
      if (c.rank == op.root) reduce_slots(c, op, round, 0, op.recv, op.count);
      break;
    case OpKind::REDUCE_SCATTER: reduce_slots(c, op, round, c.rank * block, op.recv, op.count); break;
    case OpKind::ALL_GATHER:
      for (int p = 0; p < c.size; p++) std::memcpy(op.recv + p * block, shm.slot_data(p, round), block);
      break;
    case OpKind::GATHER:
      if (c.rank == op.root)
        for (int p = 0; p < c.size; p++) std::memcpy(op.recv + p * block, shm.slot_data(p, round), block);
      break;
    case OpKind::BROADCAST:
      if (c.rank != op.root) std::memcpy(op.recv, shm.slot_data(op.root, round), block);
      break;
    default: break;  // BARRIER: the round itself is the barrier
  }
}

}  // namespace comm
