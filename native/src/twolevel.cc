// Two-level collectives for communicators that span hosts with several ranks on some host:
// the host's ranks work over shared memory, and only the host-crossing step uses the
// network, so each byte crosses a host's link once per direction instead of once per rank.
// Built from the ring, tree and recursive-doubling forms that run over a Group.
#include <cstring>

#include "algorithms.h"
#include "topology.h"

namespace comm {

namespace {

// Below this an all_reduce is latency-bound: reduce to one leader per host, all-reduce
// between leaders, broadcast inside the host (3 short phases instead of 2(L-1) ring steps).
constexpr size_t kShardMinBytes = 64 << 10;
constexpr size_t kRdMaxBytes = 64 << 10;  // as in select.cc: recursive doubling only while small

// Scratch slots 0-2 belong to the ring and tree, 3 to the PREMUL_SUM input (engine.cc).
constexpr int kPackScratch = 4;

char* at(char* base, size_t elems, const Coll& op) { return base + elems * op.elem; }

// Input blocks reordered so that each local rank's share is contiguous: block (l, h), at
// l*H + h, is the block of the rank at position l on host h.
template <class Copy>
void for_each_block(const Topology& t, Copy copy) {
  const int hosts = static_cast<int>(t.hosts.size()), per_host = t.local.size();
  for (int l = 0; l < per_host; l++)
    for (int h = 0; h < hosts; h++) copy(l * hosts + h, t.hosts[h][l]);
}

}  // namespace

bool twolevel_fits(const Comm& c, const Coll&) { return c.hierarchical(); }
bool twolevel_uniform_fits(const Comm& c, const Coll&) { return c.hierarchical() && c.topo.uniform(); }

// Large and uniform: reduce-scatter inside the host (local rank l owns block l), all-reduce
// of block l with the l-th rank of every other host (all local ranks in parallel, each on
// its own connections), all-gather inside the host. Otherwise the leader form.
void twolevel_all_reduce(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const size_t bytes = op.count * op.elem;
  if (t.uniform() && bytes >= kShardMinBytes) {
    const Blocks b{op.count, t.local.size()};
    ring_reduce_to_blocks(c, t.local, op, b);
    Coll shard = op;
    shard.send = shard.recv = at(op.recv, b.offset(t.local.me), op);
    shard.count = b.size(t.local.me);
    ring_all_reduce(c, t.cross, shard);
    ring_gather_blocks(c, t.local, op, op.recv, b);
    return;
  }
  Coll up = op;
  up.root = 0;  // the leader is each host's lowest rank
  tree_reduce(c, t.local, up);
  const Group leaders = t.leaders(c.rank, 0);
  Coll top = op;
  top.send = op.recv;
  if (leaders.me >= 0) {
    if (bytes <= kRdMaxBytes) rd_all_reduce(c, leaders, top);
    else ring_all_reduce(c, leaders, top);
  }
  top.root = 0;
  tree_broadcast(c, t.local, top);
}

// Uniform only: the input reordered (for_each_block), reduce-scatter inside the host leaves
// local rank l the host's sum of the H blocks meant for position l on every host; a
// reduce-scatter between those ranks (by host) hands each its own block.
void twolevel_reduce_scatter(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const size_t hosts = t.hosts.size(), n = c.size, share = hosts * op.count;
  char* packed = c.scratch(kPackScratch, n * op.count * op.elem);
  for_each_block(t, [&](int dst, int src) {
    std::memcpy(at(packed, dst * op.count, op), at(const_cast<char*>(op.send), src * op.count, op), op.count * op.elem);
  });
  Coll inside = op;
  inside.send = inside.recv = packed;
  inside.count = n * op.count;
  ring_reduce_to_blocks(c, t.local, inside, Blocks{n * op.count, t.local.size()});
  Coll across = op;
  across.send = at(packed, t.local.me * share, op);
  ring_reduce_scatter(c, t.cross, across);
}

// Uniform only: the reverse of twolevel_reduce_scatter: all-gather between the ranks at one
// local position (by host), all-gather of those shares inside the host, then each block to
// its rank's place.
void twolevel_all_gather(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const size_t hosts = t.hosts.size(), n = c.size, share = hosts * op.count;
  char* packed = c.scratch(kPackScratch, n * op.count * op.elem);
  Coll across = op;
  across.recv = at(packed, t.local.me * share, op);
  ring_all_gather(c, t.cross, across);
  Coll inside = op;
  inside.count = n * op.count;
  ring_gather_blocks(c, t.local, inside, packed, Blocks{n * op.count, t.local.size()});
  for_each_block(t, [&](int src, int dst) {
    std::memcpy(at(op.recv, dst * op.count, op), at(packed, src * op.count, op), op.count * op.elem);
  });
}

// Across the hosts' leaders (the root leads its own host), then inside each host.
void twolevel_broadcast(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const Group leaders = t.leaders(c.rank, op.root);
  if (leaders.me >= 0) {
    Coll top = op;
    top.root = leaders.position(op.root);
    tree_broadcast(c, leaders, top);
  }
  Coll inside = op;
  inside.root = t.local.position(t.leader(op.root));
  tree_broadcast(c, t.local, inside);
}

// Inside each host to its leader, then across the leaders to the root.
void twolevel_reduce(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const int leader = t.leader(op.root);
  Coll inside = op;
  inside.root = t.local.position(leader);
  // A leader other than the root keeps its host's sum in scratch: its output is not written.
  if (c.rank == leader && c.rank != op.root) inside.recv = c.scratch(kPackScratch, op.count * op.elem);
  tree_reduce(c, t.local, inside);
  const Group leaders = t.leaders(c.rank, op.root);
  if (leaders.me < 0) return;
  Coll top = op;
  top.send = inside.recv;
  top.root = leaders.position(op.root);
  tree_reduce(c, leaders, top);
}

// Everyone in the host has arrived, the leaders agree, the host is released.
void twolevel_barrier(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  dissemination_barrier(c, t.local, op);
  const Group leaders = t.leaders(c.rank, 0);
  if (leaders.me >= 0) dissemination_barrier(c, leaders, op);
  dissemination_barrier(c, t.local, op);
}

}  // namespace comm
