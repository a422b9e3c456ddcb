// Two-level collectives for communicators that span hosts with several ranks on some host:
// the host's ranks work over shared memory, and only the host-crossing step uses the
// network, so each byte crosses a host's link once per direction instead of once per rank.
// Built from the ring, tree and recursive-doubling forms that run over a Group.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "algorithms/algorithms.h"
#include "core/topology.h"
#include "algorithms/twolevel.h"

namespace comm {

namespace {

// Below this an all_reduce is latency-bound: reduce to one leader per host, all-reduce
// between leaders, broadcast inside the host (3 short phases instead of 2(L-1) ring steps).
constexpr size_t kShardMinBytes = 64 << 10;
constexpr size_t kRdMaxBytes = 64 << 10;  // as in select.cc: recursive doubling only while small

// Scratch slots 0-2 belong to the ring and tree, 3 to the PREMUL_SUM input (engine.cc);
// 4 holds a reordered buffer, 5 what arrives from the network beside a ring's chunk, 6 the
// network lane's partial sum beside the host's tree.
constexpr int kPackScratch = 4;
constexpr int kNetScratch = 5;
constexpr int kNetAccScratch = 6;

// Which local rank of host `h` reduces (reduce_scatter) or spreads (all_gather) the host's
// share of each rank's block. Every rank owns its own block; the blocks of the other hosts'
// ranks are dealt out to the host's ranks in rank order (H-1 each when every host holds L).
struct Owners {
  std::vector<std::vector<int>> blocks;  // blocks[l]: the ranks whose block local rank l owns, its own first
  std::vector<int> owner;                // owner[rank]: the local position that owns rank's block
  Owners(const Topology& t, int h, int n) : blocks(t.hosts[h].size()), owner(n, -1) {
    const int per_host = static_cast<int>(t.hosts[h].size());
    for (int l = 0; l < per_host; l++) blocks[l].push_back(t.hosts[h][l]), owner[t.hosts[h][l]] = l;
    int dealt = 0;
    for (int r = 0; r < n; r++)
      if (owner[r] < 0) blocks[dealt % per_host].push_back(r), owner[r] = dealt++ % per_host;
  }
  // The rank on host `h` that owns `rank`'s block.
  static int on(const Topology& t, int h, int rank, int n) { return t.hosts[h][Owners(t, h, n).owner[rank]]; }
  // Blocks of `count` elements grouped by owner: owner l's at offset(l), size(l).
  CountedBlocks layout(size_t count) const {
    std::vector<uint64_t> counts;
    for (const auto& b : blocks) counts.push_back(b.size() * count);
    return CountedBlocks(counts);
  }
};

// all_reduce: segment k of the buffer is reduce-scattered inside the host (local rank l
// owns block l of it), block l all-reduced with the l-th rank of every other host, and
// all-gathered inside the host, all in op.recv.
class ShardedAllReduce final : public TwoLevelPipeline {
 public:
  ShardedAllReduce(Comm& c, const Coll& op)
      : TwoLevelPipeline(c, op, op.count, op.count * op.elem, true, true),
        host_tmp_(c.scratch(0, ring_chunk_bytes(c, op.elem))),
        net_tmp_(c.scratch(kNetScratch, ring_chunk_bytes(c, op.elem))) {}

 private:
  std::unique_ptr<Steps> start(Phase phase, int k) override {
    const size_t e = op_.elem;
    Coll seg = op_;  // count stays the op's: it is the signature in the headers
    seg.send = op_.send + segs_.offset(k) * e;
    seg.recv = op_.recv + segs_.offset(k) * e;
    const Blocks inside{segs_.size(k), t_.local.size()};
    if (phase == RS) return ring_reduce_to_blocks_steps(c_, t_.local, seg, inside, host_tmp_);
    if (phase == AG) return ring_gather_blocks_steps(c_, t_.local, seg, seg.recv, inside);
    Coll shard = seg;
    shard.send = shard.recv = seg.recv + inside.offset(t_.local.me) * e;
    const Blocks across{inside.size(t_.local.me), t_.cross.size()};
    return std::make_unique<Then>(ring_reduce_to_blocks_steps(c_, t_.cross, shard, across, net_tmp_),
                                  ring_gather_blocks_steps(c_, t_.cross, shard, shard.recv, across));
  }

  char* const host_tmp_;
  char* const net_tmp_;
};

}  // namespace

std::vector<int> shard_owners(const Topology& t, int h, int n) { return Owners(t, h, n).owner; }

bool twolevel_fits(const Comm& c, const Coll&) { return c.hierarchical(); }
// reduce_scatter / all_gather: a host of one rank sends (reduce_scatter) or receives
// (all_gather) n-1 blocks whichever way, as many as the flat ring puts on each link it
// crosses, so two levels pay only when every host holds two or more ranks.
bool twolevel_shards_fit(const Comm& c, const Coll&) { return c.hierarchical() && c.topo.every_host_shared(); }

// Large and uniform: reduce-scatter inside the host (local rank l owns block l), all-reduce
// of block l with the l-th rank of every other host (all local ranks in parallel, each on
// its own connections), all-gather inside the host. Otherwise the leader form.
void twolevel_all_reduce(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const size_t bytes = op.count * op.elem;
  if (t.uniform() && bytes >= kShardMinBytes) {
    ShardedAllReduce(c, op).run();
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

namespace {

// One step of transfers given up front (OwnedShards' exchanges across hosts).
class Exchange final : public Steps {
 public:
  explicit Exchange(std::vector<Transfer> ts) : ts_(std::move(ts)) {}
  int width() const override { return static_cast<int>(ts_.size()); }
  int next(Transfer* ts) override {
    if (posted_) return 0;
    posted_ = true;
    std::copy(ts_.begin(), ts_.end(), ts);
    return static_cast<int>(ts_.size());
  }

 private:
  std::vector<Transfer> ts_;
  bool posted_ = false;
};

// reduce_scatter and all_gather (every host of two or more ranks), in the same segments:
// segment k of every rank's block is packed grouped by owner (Owners, each owner's own
// block first in its group). reduce_scatter: RSk, a ring reduce-scatter inside the host,
// leaves each owner the host's sum of segment k of its blocks; Xk sends
// those partial sums to their ranks across the hosts and receives the partials of its own
// block's segment k from every other host, which it adds up. all_gather: Xk sends this
// rank's segment k to its owner on every other host and receives those of the blocks it
// owns; AGk all-gathers the groups inside the host, and each block goes to its rank's place.
// Each host sends every remote rank's block once: (n - L) blocks out of a host of L ranks.
class OwnedShards final : public TwoLevelPipeline {
 public:
  OwnedShards(Comm& c, const Coll& op, bool reduce)
      : TwoLevelPipeline(c, op, op.count, c.size * op.count * op.elem, reduce, !reduce), reduce_(reduce),
        own_(c.topo, c.topo.host, c.size), packed_(c.scratch(kPackScratch, c.size * op.count * op.elem)),
        partials_(reduce ? c.scratch(kNetScratch, (c.topo.hosts.size() - 1) * op.count * op.elem) : nullptr),
        host_tmp_(c.scratch(0, ring_chunk_bytes(c, op.elem))) {}

 private:
  int width() const override {
    return static_cast<int>(c_.topo.hosts.size() - 1 + own_.blocks[c_.topo.local.me].size() - 1);
  }
  char* seg_at(int k) const { return packed_ + c_.size * segs_.offset(k) * op_.elem; }
  char* mine(int k) const { return seg_at(k) + own_.layout(segs_.size(k)).offset(c_.topo.local.me) * op_.elem; }
  // copy(rank, its block's place in segment k's packing) for every rank, in the grouped order.
  template <class Copy>
  void each_block(int k, Copy copy) const {
    char* at = seg_at(k);
    for (const auto& owned : own_.blocks)
      for (int r : owned) copy(r, at), at += segs_.size(k) * op_.elem;
  }
  // The owner of this rank's block on every other host, in host order (partial i is the i-th's).
  std::vector<int> owners_elsewhere() const {
    std::vector<int> to;
    for (int h = 0; h < static_cast<int>(t_.hosts.size()); h++)
      if (h != t_.host) to.push_back(Owners::on(t_, h, c_.rank, c_.size));
    return to;
  }

  std::unique_ptr<Steps> start(Phase phase, int k) override {
    const size_t e = op_.elem, sk = segs_.size(k), off = segs_.offset(k) * e, bytes = sk * e;
    const CountedBlocks layout = own_.layout(sk);
    Coll seg = op_;  // count stays the op's: it is the signature in the headers
    seg.send = seg.recv = seg_at(k);
    if (phase == RS) {
      each_block(k, [&](int r, char* at) { std::memcpy(at, op_.send + r * op_.count * e + off, bytes); });
      return ring_reduce_to_blocks_steps(c_, t_.local, seg, layout, host_tmp_);
    }
    if (phase == AG) return ring_gather_blocks_steps(c_, t_.local, seg, seg_at(k), layout);
    const WireHeader h = op_.header(0);
    const auto& owned = own_.blocks[t_.local.me];
    std::vector<Transfer> ts;
    if (reduce_) {
      for (size_t j = 1; j < owned.size(); j++) ts.push_back(c_.send_to(owned[j], mine(k) + j * bytes, bytes, h));
      const std::vector<int> from = owners_elsewhere();
      for (size_t i = 0; i < from.size(); i++) ts.push_back(c_.recv_from(from[i], partial(k, i), bytes, h));
    } else {
      std::memcpy(mine(k), op_.send + off, bytes);
      for (int to : owners_elsewhere()) ts.push_back(c_.send_to(to, op_.send + off, bytes, h));
      for (size_t j = 1; j < owned.size(); j++) ts.push_back(c_.recv_from(owned[j], mine(k) + j * bytes, bytes, h));
    }
    return std::make_unique<Exchange>(std::move(ts));
  }

  void finished(Phase phase, int k) override {
    const size_t e = op_.elem, sk = segs_.size(k), off = segs_.offset(k) * e;
    if (phase == X && reduce_) {  // this rank's block: its host's sum (first in its group), then the others'
      char* out = op_.recv + off;
      op_.reduce(out, mine(k), partial(k, 0), sk);
      for (size_t i = 1; i + 1 < t_.hosts.size(); i++) op_.reduce(out, out, partial(k, i), sk);
    }
    if (phase == AG)
      each_block(k, [&](int r, const char* at) { std::memcpy(op_.recv + r * op_.count * e + off, at, sk * e); });
  }

  // Where the partial of segment k from the i-th other host lands.
  char* partial(int k, size_t i) const {
    return partials_ + ((t_.hosts.size() - 1) * segs_.offset(k) + i * segs_.size(k)) * op_.elem;
  }

  const bool reduce_;  // reduce_scatter, else all_gather
  const Owners own_;
  char* const packed_;
  char* const partials_;
  char* const host_tmp_;
};

}  // namespace

void twolevel_reduce_scatter(Comm& c, const Coll& op) {
  OwnedShards(c, op, true).run();
}

void twolevel_all_gather(Comm& c, const Coll& op) {
  OwnedShards(c, op, false).run();
}

// Across the hosts' leaders (the root leads its own host), then inside each host.
// A leader forwards each chunk inside its host as soon as it has arrived from the network
// (two lanes), so the host's tree runs behind the leaders' instead of after it.
void twolevel_broadcast(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const Group leaders = t.leaders(c.rank, op.root);
  Coll inside = op;
  inside.root = t.local.position(t.leader(op.root));
  if (leaders.me < 0) {
    tree_broadcast(c, t.local, inside);
    return;
  }
  Coll top = op;
  top.root = leaders.position(op.root);
  TreeBroadcast network(c, leaders, top);
  TreeBroadcast host(c, t.local, inside, &network);  // this leader is the host tree's root
  Steps* lanes[] = {&network, &host};
  c.run_lanes(lanes, 2);
}

// Inside each host to its leader, then across the leaders to the root. A leader sends each
// chunk of its host's sum across as soon as it is complete (two lanes).
void twolevel_reduce(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const int leader = t.leader(op.root);
  Coll inside = op;
  inside.root = t.local.position(leader);
  const Group leaders = t.leaders(c.rank, op.root);
  if (leaders.me < 0) {
    tree_reduce(c, t.local, inside);
    return;
  }
  // A leader other than the root keeps its host's sum in scratch: its output is not written.
  if (c.rank != op.root) inside.recv = c.scratch(kPackScratch, op.count * op.elem);
  Coll top = op;
  top.send = inside.recv;
  top.root = leaders.position(op.root);
  const size_t chunk = ring_chunk_bytes(c, op.elem);
  TreeReduce host(c, t.local, inside, c.scratch(0, chunk), nullptr);  // this leader is its root
  TreeReduce network(c, leaders, top, c.scratch(kNetScratch, chunk), c.scratch(kNetAccScratch, chunk), &host);
  Steps* lanes[] = {&host, &network};
  c.run_lanes(lanes, 2);
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
