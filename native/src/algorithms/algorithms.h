// Every algorithm is a function over a Comm and one Coll. Adding one: write it in its
// family's file and add a row to the table in select.cc.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/comm.h"
#include "core/op.h"
#include "core/topology.h"

namespace comm {

// The forms taking a Group run over that subset of ranks (topology.h), with roots given as
// positions in it; the two-level algorithms are built from them. The others run over the
// whole communicator.
// ring.cc: bandwidth-optimal, any topology
void ring_all_reduce(Comm& c, const Coll& op);
void ring_reduce_scatter(Comm& c, const Coll& op);
void ring_all_gather(Comm& c, const Coll& op);
void ring_all_reduce(Comm& c, const Group& g, const Coll& op);
void ring_reduce_scatter(Comm& c, const Group& g, const Coll& op);
void ring_all_gather(Comm& c, const Group& g, const Coll& op);
// The halves of ring_all_reduce: afterwards block g.me of `b` (over op.count) is reduced in
// op.recv; then every block of `buf` is in place everywhere.
void ring_reduce_to_blocks(Comm& c, const Group& g, const Coll& op, const Blocks& b);
void ring_gather_blocks(Comm& c, const Group& g, const Coll& op, char* buf, const Blocks& b);
void ring_reduce_to_blocks(Comm& c, const Group& g, const Coll& op, const CountedBlocks& b);
void ring_gather_blocks(Comm& c, const Group& g, const Coll& op, char* buf, const CountedBlocks& b);
// The scratch a ring reduction receives one chunk into (opt.chunk_bytes, whole elements).
inline size_t ring_chunk_bytes(const Comm& c, size_t elem) { return chunk_elems(c.opt.chunk_bytes, elem) * elem; }
// The same halves as Steps (for Comm::run_lanes), over a group of two or more; `tmp` holds
// ring_chunk_bytes. Headers carry op's signature, layouts come from `b`.
std::unique_ptr<Steps> ring_reduce_to_blocks_steps(Comm& c, const Group& g, const Coll& op, const Blocks& b,
                                                   char* tmp);
std::unique_ptr<Steps> ring_gather_blocks_steps(Comm& c, const Group& g, const Coll& op, char* buf, const Blocks& b);
std::unique_ptr<Steps> ring_reduce_to_blocks_steps(Comm& c, const Group& g, const Coll& op, const CountedBlocks& b,
                                                   char* tmp);
std::unique_ptr<Steps> ring_gather_blocks_steps(Comm& c, const Group& g, const Coll& op, char* buf,
                                                const CountedBlocks& b);
// tree.cc: binomial tree, latency log2(n)
void tree_broadcast(Comm& c, const Coll& op);
void tree_reduce(Comm& c, const Coll& op);
void tree_all_reduce(Comm& c, const Coll& op);
void tree_broadcast(Comm& c, const Group& g, const Coll& op);
void tree_reduce(Comm& c, const Group& g, const Coll& op);
// What the tree's Steps share: the binomial tree over g (op.root a position in it), op in
// chunks of opt.chunk_bytes, and the header every chunk carries.
struct TreeChunks {
  TreeChunks(Comm& c, const Group& g, const Coll& op);
  size_t offset(int k) const { return k * step * op.elem; }  // chunk k's byte offset
  size_t elems(int k) const { return std::min(step, op.count - std::min(k * step, op.count)); }
  Comm& c;
  const Group& g;
  const Coll op;
  const BinomialTree tree;
  const size_t step;  // elements per chunk
  const int chunks;
  const WireHeader h;
};
// The broadcast as Steps, pipelined: each step receives chunk k+1 from the parent while it
// sends chunk k to the children. At the tree's root, `feed` (another broadcast, in another
// lane) says how many chunks are in op.recv: the two-level broadcast forwards each chunk
// inside the host as soon as it has crossed the network.
class TreeBroadcast final : public Steps {
 public:
  TreeBroadcast(Comm& c, const Group& g, const Coll& op, const TreeBroadcast* feed = nullptr);
  int width() const override { return 1 + static_cast<int>(t_.tree.children.size()); }
  int next(Transfer* ts) override;
  int have() const;  // chunks complete in op.recv

 private:
  const TreeChunks t_;
  const TreeBroadcast* const feed_;
  int received_ = 0, sent_ = 0;  // chunks received from the parent, sent to every child
  bool recv_posted_ = false, send_posted_ = false;
};
// The reduce as Steps, chunk by chunk: the children's partial sums of a chunk (smallest
// subtree first) folded into `acc`, which goes to the parent; the root folds into op.recv.
// `tmp` and `acc` hold a chunk each (acc unused at the root). With a `feed` (another reduce,
// in another lane, whose op.recv is this one's op.send), chunk k starts once the feed has
// finished it: the two-level reduce sends each chunk of the host's sum across the network
// as soon as it is complete.
class TreeReduce final : public Steps {
 public:
  TreeReduce(Comm& c, const Group& g, const Coll& op, char* tmp, char* acc, const TreeReduce* feed = nullptr);
  int width() const override { return 1; }
  int next(Transfer* ts) override;
  int have() const { return done_; }  // chunks complete (in op.recv at the root)

 private:
  const TreeChunks t_;
  char* const tmp_;
  char* const acc_;
  const TreeReduce* const feed_;
  int done_ = 0;
  size_t child_ = 0;           // children folded into the current chunk
  bool started_ = false;       // the current chunk's own input is there
  const char* left_ = nullptr;  // the current chunk's sum so far
  enum class Posted { NONE, RECV, SEND } posted_ = Posted::NONE;
};
// rd.cc: recursive doubling (small all_reduce) and the dissemination barrier
void rd_all_reduce(Comm& c, const Coll& op);
void dissemination_barrier(Comm& c, const Coll& op);
void rd_all_reduce(Comm& c, const Group& g, const Coll& op);
void dissemination_barrier(Comm& c, const Group& g, const Coll& op);
// twolevel.cc: across hosts, shared memory inside each host (Comm::hierarchical)
void twolevel_all_reduce(Comm& c, const Coll& op);
void twolevel_reduce_scatter(Comm& c, const Coll& op);
void twolevel_all_gather(Comm& c, const Coll& op);
void twolevel_broadcast(Comm& c, const Coll& op);
void twolevel_reduce(Comm& c, const Coll& op);
void twolevel_barrier(Comm& c, const Coll& op);
bool twolevel_fits(const Comm& c, const Coll& op);
bool twolevel_shards_fit(const Comm& c, const Coll& op);  // every host holds two or more ranks
// For every rank, the local position on host h that owns its block (reduce_scatter / all_gather).
std::vector<int> shard_owners(const Topology& t, int h, int n);
// twolevel_compress.cc: all_reduce, reduce_scatter, all_gather or a v form with a compressed wire
// (op.wire, float32 data); returns the name of the form it ran
const char* compressed_collective(Comm& c, const Coll& op);
// twolevel_a2a.cc: all_to_all aggregated per host pair
void twolevel_all_to_all(Comm& c, const Coll& op);
bool twolevel_a2a_fits(const Comm& c, const Coll& op);
// pairwise.cc: personalised exchanges
void pairwise_all_to_all(Comm& c, const Coll& op);
void linear_gather(Comm& c, const Coll& op);
void linear_scatter(Comm& c, const Coll& op);
// direct.cc: every rank on one host, payload copied through shared-memory slots
void direct_collective(Comm& c, const Coll& op);
bool direct_fits(const Comm& c, const Coll& op);
// out[0:n) = slot[0] op slot[1] op ... (each at `offset` of its slot's data), in rank order,
// identical on every rank.
void reduce_slots(const Comm& c, const Coll& op, uint64_t round, size_t offset, char* out, size_t n);
// cma.cc: every rank on one host, single-copy reads of peers' buffers (process_vm_readv)
void cma_all_reduce(Comm& c, const Coll& op);
// all_reduce by cma or the ring, whichever local rank 0 measures faster (local_tuner.h); sets c.ran
void local_all_reduce(Comm& c, const Coll& op);
void cma_reduce_scatter(Comm& c, const Coll& op);
void cma_all_gather(Comm& c, const Coll& op);
void cma_broadcast(Comm& c, const Coll& op);
bool cma_fits(const Comm& c, const Coll& op);
// A round with no payload: everyone finished the previous phase.
void sync_round(Comm& c);
// bytes at `addr` of local peer `peer`'s memory into dst (PEER_FAILURE if it cannot be read).
void read_peer(Comm& c, int peer, uint64_t addr, char* dst, size_t bytes);
// An all_to_all's receives checked with Transfer::Check::SPLITS: the first one whose lengths
// disagreed, and the rank whose block it was. The exchange runs to its end on every rank
// first; then raise() fails with Mismatch naming that rank (as fail_splits says it).
struct SplitsDisagreement {
  std::optional<Transfer> t;
  int source = -1;
  void note(const Transfer& got, int src) {
    if (!t && (got.got.len != got.hdr.len || got.got.count != got.hdr.count)) t = got, source = src;
  }
  void raise() const {
    if (t) fail_splits(t->got, t->hdr, source);
  }
};
// a2a.cc: all_to_all with every rank on one host: through the slots when every rank's input
// fits, else single-copy reads (cma, for large inputs) or pairwise. The cma row forces reads.
void direct_all_to_all(Comm& c, const Coll& op);
void cma_all_to_all(Comm& c, const Coll& op);
bool all_local(const Comm& c, const Coll& op);

// ring.cc / vcoll.cc / cma.cc: v-collectives (blocks of any size, counts in op.recv_counts)
void ring_all_gather_v(Comm& c, const Coll& op);
void ring_reduce_scatter_v(Comm& c, const Coll& op);
void direct_all_gather_v(Comm& c, const Coll& op);
void direct_reduce_scatter_v(Comm& c, const Coll& op);
bool direct_v_fits(const Comm& c, const Coll& op);
void cma_all_gather_v(Comm& c, const Coll& op);
void cma_reduce_scatter_v(Comm& c, const Coll& op);
// The value a v-collective's headers carry in `count`: equal counts, equal fingerprints.
uint64_t counts_fingerprint(const std::vector<uint64_t>& counts);
// Proves every rank of the group passed the same counts, before any payload moves; else
// MISMATCH naming both ranks' counts. Every v algorithm starts with it (or, on one host,
// with publish_counts / check_counts in its first slot round), so ranks that disagree fail
// whichever algorithm each chose.
void agree_on_counts(Comm& c, const Coll& op);
// Bytes at the start of a slot's data that hold the counts; the payload follows.
size_t counts_area(const Comm& c);
void publish_counts(const Comm& c, const Coll& op, uint64_t round);
// MISMATCH unless local peer `p`'s slot of `round` holds this op (counts named when they differ).
void check_counts(const Comm& c, const Coll& op, uint64_t round, int p);

// plan.cc: the peers the algorithms can exchange data with from this topology (every rank
// computes the same symmetric relation); others are reached on first use.
std::vector<int> planned_peers(const Comm& c);
// Every rank's planned peers at once (host_of: a host label per rank; algo: COMM_ALGO), as
// planned_peers would give each: what a simulation of the bootstrap at thousands of ranks needs
// without an engine per simulated rank.
std::vector<std::vector<int>> planned_peers_all(const std::vector<int>& host_of, const std::string& algo);

struct Algorithm {
  const char* name;
  AlgorithmFn run;
};
// The algorithm for `op`: COMM_ALGO when it names one usable here, else by size and topology.
// Every rank must choose the same one, so the choice depends only on the op's signature,
// the group's topology and the environment.
Algorithm choose_algorithm(const Comm& c, const Coll& op);
// Every name choose_algorithm accepts (each once, in table order): what COMM_ALGO may say.
std::vector<std::string> algorithm_names();

}  // namespace comm
