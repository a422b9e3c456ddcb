// Single-copy path for large payloads with every rank on one host. Ranks publish the
// addresses of their user buffers in their slot; each rank then reads what it needs
// straight out of the peers' buffers with process_vm_readv (Cross Memory Attach), in
// L2-sized chunks that are reduced while still in cache. all_reduce moves (n-1)/n of the
// buffer per rank per phase like the ring, but with one copy instead of two and no
// per-step synchronisation: three flag rounds in total.

#include <cstring>

#include "algorithms/algorithms.h"
#include "core/topology.h"

namespace comm {

namespace {

constexpr size_t kCmaChunkBytes = 256 << 10;

struct Remote {
  pid_t pid;
  uint64_t send;
  uint64_t recv;
};

// Round 1: publish our buffers and learn everyone's (after checking they run the same op;
// a v-collective also publishes its counts, and checks them). choice: local rank 0's in, and
// everyone's out.
std::vector<Remote> exchange_addresses(Comm& c, const Coll& op, size_t bytes, uint32_t* choice = nullptr) {
  const ShmDomain& shm = *c.shm;
  const bool v = op.kind == OpKind::ALL_GATHER_V || op.kind == OpKind::REDUCE_SCATTER_V;
  const uint64_t round = c.begin_round();
  Slot* mine = shm.slot(shm.me(), round);
  if (v) publish_counts(c, op, round);
  else mine->hdr = op.header(bytes);
  mine->send_addr = reinterpret_cast<uint64_t>(op.send);
  mine->recv_addr = reinterpret_cast<uint64_t>(op.recv);
  if (choice && shm.me() == 0) mine->choice = *choice;
  c.publish_round(round);
  c.wait_round(round);
  if (choice) *choice = shm.slot(0, round)->choice;
  std::vector<Remote> peers(c.size);
  for (int p = 0; p < c.size; p++) {
    const Slot* s = shm.slot(p, round);
    if (p != shm.me()) v ? check_counts(c, op, round, p) : check_header(s->hdr, mine->hdr, p);
    peers[p] = {static_cast<pid_t>(shm.seg(p)->pid), s->send_addr, s->recv_addr};
  }
  return peers;
}

void read_remote(Comm& c, const Remote& from, int peer, uint64_t addr, char* dst, size_t bytes) {
  if (read_process(from.pid, addr, dst, bytes)) return;
  const int err = errno;
  c.check_alive();  // a peer that died says so, rather than "cannot read"
  errno = err;
  fail_unreadable(peer);
}

void write_remote(Comm& c, const Remote& to, int peer, uint64_t addr, const char* src, size_t bytes) {
  if (write_process(to.pid, addr, src, bytes)) return;
  const int err = errno;
  c.check_alive();  // a peer that died says so, rather than "cannot write"
  fail(ErrorCode::PEER_FAILURE, peer, "cannot write the buffer of rank " + std::to_string(peer) +
                                          " (process_vm_writev: " + (err ? std::strerror(err) : "short copy") + ")");
}

// out[0:n) = in[0:n) op (block at `offset` of every peer's send buffer), chunk by chunk.
void reduce_from_peers(Comm& c, const Coll& op, const std::vector<Remote>& peers,
                       size_t offset, const char* in, char* out, size_t n) {
  const size_t step = chunk_elems(kCmaChunkBytes, op.elem);
  char* tmp = c.scratch(0, step * op.elem);
  for (size_t off = 0; off < n; off += step) {
    const size_t len = std::min(step, n - off);
    const char* left = in + off * op.elem;
    for (int p = 0; p < c.size; p++) {
      if (p == c.rank) continue;
      read_remote(c, peers[p], p, peers[p].send + offset + off * op.elem, tmp, len * op.elem);
      op.reduce(out + off * op.elem, left, tmp, len);
      left = out + off * op.elem;
    }
  }
}

// Each rank reduces its block chunk by chunk and writes every finished chunk, still in cache,
// into the peers' outputs: two flag rounds, and no second pass over memory to read the
// results back (a third round cost what native/TUNING.md, "cma's all_reduce writes its
// results", shows).
// Nobody else touches those bytes meanwhile: a rank reads only its own block of the peers'
// inputs, and in place that block of a peer is written only by that block's owner, after it
// has read it.
void reduce_and_write(Comm& c, const Coll& op, const std::vector<Remote>& peers) {
  const Blocks b{op.count, c.size};
  const size_t first = b.offset(c.rank), n = b.size(c.rank);
  const size_t step = chunk_elems(kCmaChunkBytes, op.elem);
  for (size_t off = 0; off < n; off += step) {
    const size_t len = std::min(step, n - off), at = (first + off) * op.elem;
    reduce_from_peers(c, op, peers, at, op.send + at, op.recv + at, len);
    for (int p = 0; p < c.size; p++)
      if (p != c.rank) write_remote(c, peers[p], p, peers[p].recv + at, op.recv + at, len * op.elem);
  }
  sync_round(c);  // every block is in every output; nobody returns while being written
}

}  // namespace

void sync_round(Comm& c) {
  const uint64_t round = c.begin_round();
  c.publish_round(round);
  c.wait_round(round);
}

void read_peer(Comm& c, int peer, uint64_t addr, char* dst, size_t bytes) {
  read_remote(c, Remote{static_cast<pid_t>(c.shm->seg(peer)->pid), 0, 0}, peer, addr, dst, bytes);
}

bool cma_fits(const Comm& c, const Coll& op) {
  return c.all_local() && c.cma &&
         (op.kind == OpKind::ALL_REDUCE || op.kind == OpKind::REDUCE_SCATTER ||
          op.kind == OpKind::ALL_GATHER || op.kind == OpKind::BROADCAST ||
          op.kind == OpKind::ALL_GATHER_V || op.kind == OpKind::REDUCE_SCATTER_V ||
          op.kind == OpKind::ALL_TO_ALL);
}

void cma_all_reduce(Comm& c, const Coll& op) { reduce_and_write(c, op, exchange_addresses(c, op, op.count * op.elem)); }

// local_tuner.h says why the choice is measured. It has to be the same on every rank: local
// rank 0's goes out in the round that publishes cma's addresses, which cma needs anyway and
// costs the ring one flag round (a few microseconds against the 30 or more of these sizes).
void local_all_reduce(Comm& c, const Coll& op) {
  const size_t bytes = op.count * op.elem;
  uint32_t choice = c.rank == 0 ? static_cast<uint32_t>(c.tuner.choose(bytes)) : 0;
  const auto start = Clock::now();
  const auto peers = exchange_addresses(c, op, bytes, &choice);
  if (choice == LocalTuner::RING) {
    c.ran = "ring";
    ring_all_reduce(c, op);
  } else {
    c.ran = "cma";
    reduce_and_write(c, op, peers);
  }
  if (c.rank == 0)
    c.tuner.record(bytes, static_cast<LocalTuner::Choice>(choice),
                   std::chrono::duration<double, std::nano>(Clock::now() - start).count());
}

void cma_reduce_scatter(Comm& c, const Coll& op) {
  const auto peers = exchange_addresses(c, op, op.count * c.size * op.elem);
  const size_t mine = c.rank * op.count * op.elem;
  reduce_from_peers(c, op, peers, mine, op.send + mine, op.recv, op.count);
  sync_round(c);
}

void cma_all_gather(Comm& c, const Coll& op) {
  const size_t bytes = op.count * op.elem;
  const auto peers = exchange_addresses(c, op, bytes);
  if (bytes && op.send != op.recv + c.rank * bytes) std::memcpy(op.recv + c.rank * bytes, op.send, bytes);
  for (int p = 0; p < c.size; p++)
    if (p != c.rank) read_remote(c, peers[p], p, peers[p].send, op.recv + p * bytes, bytes);
  sync_round(c);
}

void cma_all_gather_v(Comm& c, const Coll& op) {
  const CountedBlocks b{*op.recv_counts};
  const auto peers = exchange_addresses(c, op, 0);
  char* mine = op.recv + b.offset(c.rank) * op.elem;
  if (b.size(c.rank) && op.send != mine) std::memcpy(mine, op.send, b.size(c.rank) * op.elem);
  for (int p = 0; p < c.size; p++)
    if (p != c.rank)
      read_remote(c, peers[p], p, peers[p].send, op.recv + b.offset(p) * op.elem, b.size(p) * op.elem);
  sync_round(c);
}

void cma_reduce_scatter_v(Comm& c, const Coll& op) {
  const CountedBlocks b{*op.recv_counts};
  const auto peers = exchange_addresses(c, op, 0);
  const size_t mine = b.offset(c.rank) * op.elem;
  reduce_from_peers(c, op, peers, mine, op.send + mine, op.recv, b.size(c.rank));
  sync_round(c);
}

void cma_broadcast(Comm& c, const Coll& op) {
  const size_t bytes = op.count * op.elem;
  const auto peers = exchange_addresses(c, op, bytes);
  if (c.rank != op.root) read_remote(c, peers[op.root], op.root, peers[op.root].recv, op.recv, bytes);
  sync_round(c);
}

}  // namespace comm
