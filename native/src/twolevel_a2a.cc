// all_to_all across hosts, aggregated per host pair (every host holds L ranks). The pairwise
// exchange sends n-L messages over the network per rank, one per remote rank; this sends
// H-1, each carrying the L blocks that the ranks of one host have for one rank of another:
//   1. the host's ranks all-gather their splits (what each sends to and expects from every
//      rank), so each knows the sizes of all the blocks its host moves;
//   2. inside the host, local rank m receives from every local rank the blocks meant for
//      position m on every host (its own into the output, the others into a stage);
//   3. across hosts, rank (h, m) sends to (h', m) the L blocks of its host's ranks meant for
//      (h', m) back to back on one stream, and receives straight into the output. Steps 2
//      and 3 overlap (Comm::run_lanes): its own blocks leave at once, each staged one as
//      soon as it arrived.
// Every block's header carries both directions of its pair of ranks, source and final
// destination, as in the pairwise exchange: `len` what it holds, `count` what its source
// expects back (the forwarder has both from step 1). The destination checks both before
// a payload byte lands, so a pair that disagrees fails with Mismatch on both of its ranks
// (naming the other), after every other block arrived; no rank waits for a block that never
// comes, nothing is written past a block.
#include <cstring>

#include "algorithms.h"

namespace comm {

namespace {

constexpr int kStageScratch = 4;  // the packing slot of twolevel.cc: unused by this op otherwise

// Every local rank's splits: what each sends to and expects from every rank.
struct HostSplits {
  std::vector<uint64_t> all;  // local position p's at p * 2n: n sends, then n expects
  std::vector<int> position;  // position[rank]: its local position, -1 off this host
  int n;
  const uint64_t* sends(int rank) const { return all.data() + 2 * static_cast<size_t>(n) * position[rank]; }
  const uint64_t* expects(int rank) const { return sends(rank) + n; }
};

// A ring all-gather of the splits over the host's ranks, on the channels every engine
// transport has. Its header carries the all_to_all's signature, so a local rank running
// another operation fails with Mismatch here.
HostSplits gather_splits(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const int n = c.size;
  HostSplits h{std::vector<uint64_t>(2 * static_cast<size_t>(n) * t.local.size()), std::vector<int>(n, -1), n};
  for (int p = 0; p < t.local.size(); p++) h.position[t.local.ranks[p]] = p;
  std::vector<uint64_t> mine(op.send_counts->begin(), op.send_counts->end());
  mine.insert(mine.end(), op.recv_counts->begin(), op.recv_counts->end());
  Coll splits = op;
  splits.send = reinterpret_cast<const char*>(mine.data());
  splits.recv = reinterpret_cast<char*>(h.all.data());
  splits.count = 2 * n;
  splits.elem = sizeof(uint64_t);
  ring_all_gather(c, t.local, splits);
  return h;
}

}  // namespace

bool twolevel_a2a_fits(const Comm& c, const Coll&) { return c.hierarchical() && c.topo.uniform(); }

void twolevel_all_to_all(Comm& c, const Coll& op) {
  const Topology& t = c.topo;
  const int n = c.size, me = c.rank, hosts = static_cast<int>(t.hosts.size()), per_host = t.local.size();
  const int m = t.local.me, h0 = t.host;
  const size_t e = op.elem;
  const std::vector<uint64_t>& sends = *op.send_counts;
  const std::vector<uint64_t>& expects = *op.recv_counts;
  std::vector<size_t> sdisp(n + 1, 0), rdisp(n + 1, 0);
  for (int i = 0; i < n; i++) {
    sdisp[i + 1] = sdisp[i] + sends[i] * e;
    rdisp[i + 1] = rdisp[i] + expects[i] * e;
  }

  // 1. The splits of every local rank.
  const HostSplits split = gather_splits(c, op);

  // The stage: for each other host h and local source l, the block l sends to (h, m).
  auto staged_at = [&](int h, int l) { return static_cast<size_t>(h) * per_host + l; };
  std::vector<size_t> stage_off(hosts * per_host + 1, 0);
  for (int h = 0; h < hosts; h++)
    for (int l = 0; l < per_host; l++) {
      const bool staged = h != h0 && l != m;
      const size_t i = staged_at(h, l);
      stage_off[i + 1] = stage_off[i] + (staged ? split.sends(t.hosts[h0][l])[t.hosts[h][m]] * e : 0);
    }
  char* stage = c.scratch(kStageScratch, stage_off.back());

  // A block from `src` to `dst`: both directions of the pair in its header.
  auto block_header = [&](int src, int dst) {
    WireHeader h = op.header(split.sends(src)[dst] * e);
    h.count = split.expects(src)[dst] * e;
    return h;
  };
  // What the destination (this rank) expects of a block from `src`.
  auto expected_header = [&](int src) {
    WireHeader h = op.header(expects[src] * e);
    h.count = sends[src] * e;
    return h;
  };
  SplitsDisagreement disagreed;
  if (sends[me]) std::memmove(op.recv + rdisp[me], op.send + sdisp[me], sends[me] * e);

  // 2. Inside the host, one local peer a step (step s: to m+s, from m-s): the blocks for
  // position m+s on every host go to m+s, those of m-s for position m arrive.
  int host_done = 0;  // steps of phase 2 finished
  StepsOf host(2 * hosts, [&, s = 0](Transfer* ts) mutable {
    if (s > 0) disagreed.note(ts[hosts + h0], t.hosts[h0][mod(m - s, per_host)]);
    host_done = s;
    if (++s >= per_host) return 0;
    const int pt = mod(m + s, per_host), pf = mod(m - s, per_host);
    const int to = t.hosts[h0][pt], from = t.hosts[h0][pf];
    for (int h = 0; h < hosts; h++) {
      const int dst = t.hosts[h][pt];
      ts[h] = c.send_to(to, op.send + sdisp[dst], sends[dst] * e, block_header(me, dst));
      if (h == h0) {
        ts[hosts + h] = c.recv_from(from, op.recv + rdisp[from], expects[from] * e, expected_header(from));
        ts[hosts + h].check = Transfer::Check::SPLITS;
      } else {
        const size_t i = staged_at(h, pf);
        ts[hosts + h] = c.recv_from(from, stage + stage_off[i], stage_off[i + 1] - stage_off[i],
                                    block_header(from, t.hosts[h][m]));
      }
    }
    return 2 * hosts;
  });
  // 3. Across hosts, to (h, m) on every other host h, the blocks of local sources m, m-1,
  // m-2, ... in turn: this rank's own at once, each staged one as soon as phase 2 brought
  // it, so the network works while the host does. (h, m) receives them in that order.
  StepsOf out(hosts - 1, [&, j = -1](Transfer* ts) mutable {
    if (j + 1 >= per_host) return 0;
    if (j + 1 > host_done) return static_cast<int>(Steps::kWait);
    const int l = mod(m - ++j, per_host), src = t.hosts[h0][l];
    for (int s = 1; s < hosts; s++) {
      const int h = mod(h0 + s, hosts), to = t.hosts[h][m];
      const char* buf = j == 0 ? op.send + sdisp[to] : stage + stage_off[staged_at(h, l)];
      ts[s - 1] = c.send_to(to, buf, split.sends(src)[to] * e, block_header(src, to));
    }
    return hosts - 1;
  });
  StepsOf in(hosts - 1, [&, j = -1](Transfer* ts) mutable {
    auto source = [&](int s) { return t.hosts[mod(h0 - s, hosts)][mod(m - j, per_host)]; };
    if (j >= 0)
      for (int s = 1; s < hosts; s++) disagreed.note(ts[s - 1], source(s));
    if (++j >= per_host) return 0;
    for (int s = 1; s < hosts; s++) {
      const int src = source(s);
      ts[s - 1] = c.recv_from(t.hosts[mod(h0 - s, hosts)][m], op.recv + rdisp[src], expects[src] * e,
                              expected_header(src));
      ts[s - 1].check = Transfer::Check::SPLITS;
    }
    return hosts - 1;
  });
  // The host lane uses the local channels, the other two the remote ones, one direction each.
  Steps* lanes[] = {&host, &out, &in};
  c.run_lanes(lanes, 3);
  disagreed.raise();
}

}  // namespace comm
