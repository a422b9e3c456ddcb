// The compressed all_reduce, reduce_scatter and all_gather (compress="bf16" / "fp8",
// comm/compress.py). all_reduce: the two-level
// pipeline of twolevel.cc whose network phase sends encoded chunks and sums what arrives in
// float32. Inside a host the data stays float32 (shared memory is not the bound); across
// hosts, segment k of this rank's shard (block local.me of the host's reduce-scatter) is
// reduce-scattered and all-gathered among the same local rank of every host in two steps:
//   1. block j of the shard (j != me) goes encoded to the j-th host's rank; the blocks that
//      arrive for block `me` are decoded and added, in float32, to this rank's own (exact)
//      block, in host order;
//   2. that sum, encoded once, goes to every other host's rank, and every rank, this one
//      included, decodes the same bytes into block `me` of the shard.
// The host's all-gather then moves those encoded packets, not float32 (a quarter or half of
// the shared-memory traffic of that phase), and each rank decodes its neighbours' shards: the
// shared-memory phases, not the link, bound a compressed 2 x 2 on two cores.
// So each element is quantized at most twice (its partial sum, then the total), every rank
// holds the same bits, and NaN / Inf travel as codes of their own. The encoding runs on the
// engine's thread between the network steps while the host lane's phases of the other
// segments proceed (run_lanes): no Python thread, no sub-communicator.
// reduce_scatter is the first half (host reduce-scatter, step 1: each element quantized
// once) and all_gather the second (step 2 on each rank's input, then the packets gathered
// inside the host), in the same segments; see their classes below.
// Where two levels do not apply (one rank per host, hosts of unequal size, one host under
// COMM_COMPRESS=force) the same exchange runs over every rank, with no host phases.
#include <cstring>
#include <memory>
#include <vector>

#include "algorithms/algorithms.h"
#include "kernels/compress.h"
#include "algorithms/twolevel.h"

namespace comm {

namespace {

// Scratch slots 7-10 (twolevel.cc and engine.cc use 0-6): encoded packets out, partial sums
// in, the final packets (the whole op's, gathered inside the host; or one segment's), and
// reduce_scatter's packed input.
constexpr int kSendPackets = 7;
constexpr int kRecvPackets = 8;
constexpr int kFinalPackets = 9;
constexpr int kPackedInput = 10;  // reduce_scatter: the input by owner, [local rank][host]

// Bytes of the packet of n elements: bf16 codes; or fp8 scales (one float per block, first,
// so they stay 4-byte aligned), then the codes.
size_t wire_bytes(const Coll& op, size_t n) {
  if (op.wire == Wire::BF16) return 2 * n;
  return 4 * ((n + op.wire_block - 1) / op.wire_block) + n;
}
size_t aligned(size_t bytes) { return (bytes + 63) & ~size_t{63}; }
// Every cut at a multiple of this many elements: fp8's scale block (each block of the
// caller's buffer keeps one scale, as documented), 16 floats (a cache line) for bf16.
size_t unit_of(const Coll& op) { return op.wire == Wire::FP8 ? op.wire_block : 16; }

void encode(const Coll& op, const char* in, char* packet, size_t n) {
  const auto& k = compress::kernels();
  const float* x = reinterpret_cast<const float*>(in);
  if (op.wire == Wire::BF16) {
    k.to_bf16(x, reinterpret_cast<uint16_t*>(packet), n);
    return;
  }
  const size_t scales = 4 * ((n + op.wire_block - 1) / op.wire_block);
  k.to_fp8(x, reinterpret_cast<uint8_t*>(packet + scales), reinterpret_cast<float*>(packet), n, op.wire_block);
}

// The packets of rows of these sizes, each 64-byte aligned.
CountedBlocks packets(const Coll& op, const std::vector<uint64_t>& sizes) {
  std::vector<uint64_t> bytes;
  for (uint64_t n : sizes) bytes.push_back(aligned(wire_bytes(op, n)));
  return CountedBlocks(bytes);
}
// The packets of `count` elements cut into n blocks of whole units.
CountedBlocks packets_of(const Coll& op, size_t count, int n) {
  const CountedBlocks b = unit_blocks(count, n, unit_of(op));
  std::vector<uint64_t> sizes;
  for (int j = 0; j < n; j++) sizes.push_back(b.size(j));
  return packets(op, sizes);
}

// acc = (accumulate ? acc : 0) + decoded packet.
void decode(const Coll& op, char* acc, const char* packet, size_t n, bool accumulate) {
  const auto& k = compress::kernels();
  float* a = reinterpret_cast<float*>(acc);
  if (op.wire == Wire::BF16) {
    k.bf16_add(a, reinterpret_cast<const uint16_t*>(packet), n, accumulate);
    return;
  }
  const size_t scales = 4 * ((n + op.wire_block - 1) / op.wire_block);
  k.fp8_add(a, reinterpret_cast<const uint8_t*>(packet + scales), reinterpret_cast<const float*>(packet), n,
            op.wire_block, accumulate);
}

// The two steps above over group g, one row per position: row j (sizes[j] elements, cut at
// whole units) is read at in[j] and lands at out[j]. reduce (step 1): every in[j] is read and
// the sum of the rows of position g.me lands at out[g.me] (may be in[g.me]); gather (step 2):
// the own row (that sum, or in[g.me] alone) is encoded once and every out[j] decoded from the
// same bytes. all_reduce runs both, reduce_scatter step 1, all_gather step 2. The packets of
// step 1 sit at j * slot in scratch (slot: the largest row's); row j's final packet at
// final + packets(sizes).offset(j).
class CompressedExchange final : public Steps {
 public:
  CompressedExchange(Comm& c, const Group& g, const Coll& op, std::vector<const char*> in, std::vector<char*> out,
                     const std::vector<uint64_t>& sizes, char* final, bool reduce, bool gather)
      : c_(c), g_(g), op_(op), in_(std::move(in)), out_(std::move(out)), b_(sizes), pk_(packets(op, sizes)),
        slot_(pk_.largest()), sent_(reduce ? c.scratch(kSendPackets, slot_ * g.size()) : nullptr),
        got_(reduce ? c.scratch(kRecvPackets, slot_ * g.size()) : nullptr), final_(final), reduce_(reduce),
        gather_(gather), h_(op.header(0)) {}  // a rank on the exact path expects other lengths: it fails at once
  int width() const override { return 2 * (g_.size() - 1); }

  int next(Transfer* ts) override {
    const int n = g_.size(), me = g_.me;
    const size_t e = op_.elem, mine = b_.size(me);
    int k = 0;
    for (;;) {
      switch (step_++) {
        case 0:  // step 1: every other row, encoded, to its owner; its partials of ours in
          if (!reduce_) continue;
          for (int j = 0; j < n; j++) {
            if (j == me) continue;
            encode(op_, in_[j], sent_ + j * slot_, b_.size(j));
            ts[k++] = c_.send_to(g_.at(j), sent_ + j * slot_, wire_bytes(op_, b_.size(j)), h_);
            ts[k++] = c_.recv_from(g_.at(j), got_ + j * slot_, wire_bytes(op_, mine), h_);
          }
          // after the encoding: out[me] may overlap another row of the caller's buffer
          if (out_[me] != in_[me]) std::memmove(out_[me], in_[me], mine * e);
          return k;
        case 1:  // step 2: our row (its sum), encoded once, to everyone; theirs in
          if (reduce_)
            for (int j = 0; j < n; j++)
              if (j != me) decode(op_, out_[me], got_ + j * slot_, mine, true);
          if (!gather_) return 0;
          encode(op_, reduce_ ? out_[me] : in_[me], final_ + pk_.offset(me), mine);
          for (int j = 0; j < n; j++) {
            if (j == me) continue;
            ts[k++] = c_.send_to(g_.at(j), final_ + pk_.offset(me), wire_bytes(op_, mine), h_);
            ts[k++] = c_.recv_from(g_.at(j), final_ + pk_.offset(j), wire_bytes(op_, b_.size(j)), h_);
          }
          return k;
        case 2:  // every row from the same bytes on every rank, ours too
          for (int j = 0; j < n; j++) decode(op_, out_[j], final_ + pk_.offset(j), b_.size(j), false);
          return 0;
        default:
          return 0;
      }
    }
  }

 private:
  Comm& c_;
  const Group& g_;
  const Coll& op_;
  const std::vector<const char*> in_;
  const std::vector<char*> out_;
  const CountedBlocks b_;
  const CountedBlocks pk_;
  const size_t slot_;
  char* const sent_;
  char* const got_;
  char* const final_;
  const bool reduce_, gather_;
  const WireHeader h_;
  int step_ = 0;
};

// The all_reduce's exchange of `count` elements of `in` into `out`, cut into g.size() rows of
// whole units.
std::unique_ptr<Steps> all_reduce_exchange(Comm& c, const Group& g, const Coll& op, const char* in, char* out,
                                           size_t count, char* final) {
  const CountedBlocks b = unit_blocks(count, g.size(), unit_of(op));
  std::vector<const char*> rows;
  std::vector<char*> outs;
  std::vector<uint64_t> sizes;
  for (int j = 0; j < g.size(); j++) {
    rows.push_back(in + b.offset(j) * op.elem);
    outs.push_back(out + b.offset(j) * op.elem);
    sizes.push_back(b.size(j));
  }
  return std::make_unique<CompressedExchange>(c, g, op, rows, outs, sizes, final, true, true);
}

// Segment k: reduce-scatter inside the host, the compressed exchange of this rank's shard
// across the hosts, all-gather of the encoded shards inside the host (their packets in
// scratch, [segment][local rank][block] at fixed places every rank computes alike), each
// neighbour's shard decoded once it is in. Without host phases (`cross` is then every rank),
// the exchange of each segment alone.
class CompressedAllReduce final : public TwoLevelPipeline {
 public:
  CompressedAllReduce(Comm& c, const Coll& op, bool two_level)
      : TwoLevelPipeline(c, op, op.count, op.count * op.elem, two_level, two_level, unit_of(op)),
        two_level_(two_level), cross_(two_level ? c.topo.cross : c.world),
        host_tmp_(two_level ? c.scratch(0, ring_chunk_bytes(c, op.elem)) : nullptr) {
    if (!two_level) return;
    std::vector<uint64_t> bytes;
    for (size_t k = 0; k + 1 < segs_.offsets.size(); k++) bytes.push_back(host_packets(k).offset(t_.local.size()));
    seg_packets_ = CountedBlocks(bytes);
    packets_ = c.scratch(kFinalPackets, seg_packets_.offset(bytes.size()));
  }

 private:
  int width() const override { return 2 * (cross_.size() - 1); }

  CountedBlocks inside(int k) const { return unit_blocks(segs_.size(k), t_.local.size(), unit_of(op_)); }
  // Segment k's encoded shards: local rank l's packets (its shard cut over the hosts), in l order.
  CountedBlocks host_packets(int k) const {
    const CountedBlocks in = inside(k);
    std::vector<uint64_t> bytes;
    for (int l = 0; l < t_.local.size(); l++) bytes.push_back(packets_of(op_, in.size(l), cross_.size()).offset(cross_.size()));
    return CountedBlocks(bytes);
  }

  std::unique_ptr<Steps> start(Phase phase, int k) override {
    const size_t e = op_.elem;
    Coll seg = op_;  // count stays the op's: it is the signature in the headers
    seg.send = op_.send + segs_.offset(k) * e;
    seg.recv = op_.recv + segs_.offset(k) * e;
    if (!two_level_) {
      char* final = c_.scratch(kFinalPackets, packets_of(op_, segs_.size(k), cross_.size()).offset(cross_.size()));
      return all_reduce_exchange(c_, cross_, op_, seg.send, seg.recv, segs_.size(k), final);
    }
    const CountedBlocks in = inside(k);
    if (phase == RS) return ring_reduce_to_blocks_steps(c_, t_.local, seg, in, host_tmp_);
    char* packets = packets_ + seg_packets_.offset(k);
    if (phase == AG) {
      Coll bytes = seg;  // the packets, as bytes
      bytes.elem = 1;
      return ring_gather_blocks_steps(c_, t_.local, bytes, packets, host_packets(k));
    }
    char* shard = seg.recv + in.offset(t_.local.me) * e;
    return all_reduce_exchange(c_, cross_, op_, shard, shard, in.size(t_.local.me),
                               packets + host_packets(k).offset(t_.local.me));
  }

  // The neighbours' shards of segment k, from the packets gathered inside the host.
  void finished(Phase phase, int k) override {
    if (phase != AG) return;
    const CountedBlocks in = inside(k), hp = host_packets(k);
    const char* packets = packets_ + seg_packets_.offset(k);
    for (int l = 0; l < t_.local.size(); l++) {
      if (l == t_.local.me) continue;
      const CountedBlocks b = unit_blocks(in.size(l), cross_.size(), unit_of(op_));
      const CountedBlocks pk = packets_of(op_, in.size(l), cross_.size());
      char* shard = op_.recv + (segs_.offset(k) + in.offset(l)) * op_.elem;
      for (int j = 0; j < cross_.size(); j++)
        decode(op_, shard + b.offset(j) * op_.elem, packets + hp.offset(l) + pk.offset(j), b.size(j), false);
    }
  }

  const bool two_level_;
  const Group& cross_;
  char* const host_tmp_;
  CountedBlocks seg_packets_{std::vector<uint64_t>{}};  // each segment's packets, whole host
  char* packets_ = nullptr;
};

// The most segments of reduce_scatter / all_gather. Two levels: the pipeline's (twolevel.h).
// Flat, no host lane hides anything, but shorter rows keep a segment's encoding and decoding
// in cache (see native/TUNING.md, "Compressed segments").
size_t segments_most(bool two_level) { return two_level ? 4 : 16; }

// reduce_scatter: rank r's output is the sum of block r (op.count elements at r * count) of
// every rank's input, as the exact reduce_scatter gives it. Segment k of every block is packed
// by local position, then host: [l][h] holds block hosts[h][l]'s segment, so the host's exact
// float32 reduce-scatter (RSk) leaves local rank l the host's sums of the blocks of position l
// on every host, one row per host, in cross order; Xk (step 1 alone) sends row h to that
// host's rank and adds, in float32, the decoded partials of its own block to its exact row,
// straight into op.recv. Each element is quantized once. Flat: the rows are the blocks of
// the caller's input itself.
class CompressedReduceScatter final : public TwoLevelPipeline {
 public:
  CompressedReduceScatter(Comm& c, const Coll& op, bool two_level)
      : TwoLevelPipeline(c, op, op.count, c.size * op.count * op.elem, two_level, false, unit_of(op),
                         segments_most(two_level)),
        two_level_(two_level), cross_(two_level ? c.topo.cross : c.world),
        packed_(two_level ? c.scratch(kPackedInput, c.size * op.count * op.elem) : nullptr),
        host_tmp_(two_level ? c.scratch(0, ring_chunk_bytes(c, op.elem)) : nullptr) {}

 private:
  int width() const override { return 2 * (cross_.size() - 1); }
  char* seg_at(int k) const { return packed_ + c_.size * segs_.offset(k) * op_.elem; }

  std::unique_ptr<Steps> start(Phase phase, int k) override {
    const size_t e = op_.elem, sk = segs_.size(k), at = segs_.offset(k) * e;
    const int hosts = cross_.size();
    std::vector<const char*> rows;
    if (phase == RS) {
      for (int l = 0; l < t_.local.size(); l++)
        for (int h = 0; h < hosts; h++)
          std::memcpy(seg_at(k) + (l * hosts + h) * sk * e, op_.send + t_.hosts[h][l] * op_.count * e + at, sk * e);
      Coll seg = op_;  // count stays the op's: it is the signature in the headers
      seg.send = seg.recv = seg_at(k);
      return ring_reduce_to_blocks_steps(c_, t_.local, seg, Blocks{t_.local.size() * hosts * sk, t_.local.size()},
                                         host_tmp_);
    }
    for (int j = 0; j < hosts; j++)
      rows.push_back(two_level_ ? seg_at(k) + (t_.local.me * hosts + j) * sk * e : op_.send + j * op_.count * e + at);
    std::vector<char*> outs(hosts, nullptr);
    outs[cross_.me] = op_.recv + at;
    return std::make_unique<CompressedExchange>(c_, cross_, op_, rows, outs, std::vector<uint64_t>(hosts, sk),
                                                nullptr, true, false);
  }

  const bool two_level_;
  const Group& cross_;
  char* const packed_;
  char* const host_tmp_;
};

// all_gather: Xk (step 2 alone) encodes segment k of this rank's input once, sends it to the
// same local rank of every host (flat: every rank) and decodes what arrives, its own packet
// too; two levels: AGk gathers those packets inside the host ([l][h]: rank hosts[h][l]'s, at
// places every rank computes alike) and each rank decodes its neighbours'. Every rank decodes
// the same bytes for every block: every rank holds the same bits, the owner included.
class CompressedAllGather final : public TwoLevelPipeline {
 public:
  CompressedAllGather(Comm& c, const Coll& op, bool two_level)
      : TwoLevelPipeline(c, op, op.count, c.size * op.count * op.elem, false, two_level, unit_of(op),
                         segments_most(two_level)),
        two_level_(two_level), cross_(two_level ? c.topo.cross : c.world) {
    std::vector<uint64_t> bytes;
    for (size_t k = 0; k + 1 < segs_.offsets.size(); k++) bytes.push_back(c.size * packet(k));
    seg_packets_ = CountedBlocks(bytes);
    packets_ = c.scratch(kFinalPackets, seg_packets_.offset(bytes.size()));
  }

 private:
  int width() const override { return 2 * (cross_.size() - 1); }
  size_t packet(int k) const { return aligned(wire_bytes(op_, segs_.size(k))); }
  // Where rank `rank`'s segment k lands.
  char* out(int rank, int k) const { return op_.recv + (rank * op_.count + segs_.offset(k)) * op_.elem; }

  std::unique_ptr<Steps> start(Phase phase, int k) override {
    const int hosts = cross_.size();
    char* packets = packets_ + seg_packets_.offset(k);
    if (phase == AG) {
      Coll bytes = op_;  // the packets, as bytes; count stays the op's (the signature)
      bytes.elem = 1;
      const size_t per_host = hosts * packet(k);
      return ring_gather_blocks_steps(c_, t_.local, bytes, packets,
                                      Blocks{t_.local.size() * per_host, t_.local.size()});
    }
    std::vector<char*> outs;
    for (int j = 0; j < hosts; j++) outs.push_back(out(cross_.at(j), k));
    std::vector<const char*> rows(hosts, nullptr);
    rows[cross_.me] = op_.send + segs_.offset(k) * op_.elem;
    char* final = packets + (two_level_ ? t_.local.me * hosts : 0) * packet(k);
    return std::make_unique<CompressedExchange>(c_, cross_, op_, rows, outs,
                                                std::vector<uint64_t>(hosts, segs_.size(k)), final, false, true);
  }

  // The neighbours' blocks of segment k, from the packets gathered inside the host.
  void finished(Phase phase, int k) override {
    if (phase != AG) return;
    const int hosts = cross_.size();
    const char* packets = packets_ + seg_packets_.offset(k);
    for (int l = 0; l < t_.local.size(); l++)
      if (l != t_.local.me)
        for (int h = 0; h < hosts; h++)
          decode(op_, out(t_.hosts[h][l], k), packets + (l * hosts + h) * packet(k), segs_.size(k), false);
  }

  const bool two_level_;
  const Group& cross_;
  CountedBlocks seg_packets_{std::vector<uint64_t>{}};  // each segment's packets, every rank's
  char* packets_ = nullptr;
};

// The v forms (counts[r] elements in rank r's block, zeros allowed): the same halves, in one
// segment (the pipelined forms cut one count for every rank). Scales restart at every block.
// reduce_scatter_v: the input packed [l][h] (block hosts[h][l]), reduced exactly inside the
// host, then step 1 across hosts into the output; all_gather_v: step 2 across hosts, the
// packets ([l][h], each its own size) gathered inside the host, every block decoded from them.
void compressed_v(Comm& c, const Coll& op, bool two_level) {
  const std::vector<uint64_t>& counts = *op.recv_counts;
  const CountedBlocks blocks(counts);  // rank r's block in the whole
  const size_t e = op.elem;
  const bool reduce = op.kind == OpKind::REDUCE_SCATTER_V;
  const Topology& t = c.topo;
  const Group& cross = two_level ? t.cross : c.world;
  const int hosts = cross.size(), locals = two_level ? t.local.size() : 1;
  // rank(l, h): the rank of position h of cross group l (flat: l = 0, h the rank)
  auto rank = [&](int l, int h) { return two_level ? t.hosts[h][l] : h; };
  const int me_l = two_level ? t.local.me : 0;
  std::vector<uint64_t> sizes(hosts), item(static_cast<size_t>(locals) * hosts);
  for (int l = 0; l < locals; l++)
    for (int h = 0; h < hosts; h++) item[l * hosts + h] = counts[rank(l, h)];
  for (int h = 0; h < hosts; h++) sizes[h] = item[me_l * hosts + h];
  std::vector<const char*> rows(hosts, nullptr);
  std::vector<char*> outs(hosts, nullptr);
  if (reduce) {
    const CountedBlocks packed_at(item);  // [l][h] in elements
    const char* in = op.send;
    if (two_level) {
      char* packed = c.scratch(kPackedInput, packed_at.offset(locals * hosts) * e);
      for (int i = 0; i < locals * hosts; i++)
        std::memcpy(packed + packed_at.offset(i) * e, op.send + blocks.offset(rank(i / hosts, i % hosts)) * e,
                    item[i] * e);
      std::vector<uint64_t> region(locals, 0);
      for (int i = 0; i < locals * hosts; i++) region[i / hosts] += item[i];
      Coll all = op;
      all.send = all.recv = packed;
      run_steps(c, *ring_reduce_to_blocks_steps(c, t.local, all, CountedBlocks(region),
                                                c.scratch(0, ring_chunk_bytes(c, e))));
      in = packed;
    }
    for (int h = 0; h < hosts; h++)
      rows[h] = in + (two_level ? packed_at.offset(me_l * hosts + h) : blocks.offset(h)) * e;
    outs[cross.me] = op.recv;
    CompressedExchange x(c, cross, op, rows, outs, sizes, nullptr, true, false);
    run_steps(c, x);
    return;
  }
  std::vector<uint64_t> bytes;
  for (uint64_t n : item) bytes.push_back(aligned(wire_bytes(op, n)));
  const CountedBlocks pk(bytes);  // [l][h] packets
  char* packets = c.scratch(kFinalPackets, pk.offset(locals * hosts));
  rows[cross.me] = op.send;
  for (int h = 0; h < hosts; h++) outs[h] = op.recv + blocks.offset(rank(me_l, h)) * e;
  CompressedExchange x(c, cross, op, rows, outs, sizes, packets + pk.offset(me_l * hosts), false, true);
  run_steps(c, x);
  if (!two_level) return;
  std::vector<uint64_t> region(locals, 0);
  for (int i = 0; i < locals * hosts; i++) region[i / hosts] += bytes[i];
  Coll raw = op;  // the packets, as bytes
  raw.elem = 1;
  run_steps(c, *ring_gather_blocks_steps(c, t.local, raw, packets, CountedBlocks(region)));
  for (int i = 0; i < locals * hosts; i++)
    if (i / hosts != me_l)
      decode(op, op.recv + blocks.offset(rank(i / hosts, i % hosts)) * e, packets + pk.offset(i), item[i], false);
}

}  // namespace

const char* compressed_collective(Comm& c, const Coll& op) {
  // The sharded forms need every host to hold the same ranks (t.cross); see twolevel_all_reduce.
  const bool two_level = c.hierarchical() && c.topo.uniform();
  if (op.kind == OpKind::REDUCE_SCATTER_V || op.kind == OpKind::ALL_GATHER_V) compressed_v(c, op, two_level);
  else if (op.kind == OpKind::REDUCE_SCATTER) CompressedReduceScatter(c, op, two_level).run();
  else if (op.kind == OpKind::ALL_GATHER) CompressedAllGather(c, op, two_level).run();
  else CompressedAllReduce(c, op, two_level).run();
  return two_level ? "compressed-twolevel" : "compressed-flat";
}

}  // namespace comm
