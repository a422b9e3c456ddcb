// all_to_all across hosts, aggregated per host pair. The pairwise exchange sends a message
// over the network for every pair of ranks on different hosts; this sends one per remote
// rank and host, carrying the blocks of all of a host's ranks for that rank. Local position
// q of a host of L ranks forwards to the ranks at positions q, q+L, q+2L, ... of every other
// host (uniform placements: to position q alone):
//   1. the host's ranks all-gather their splits (what each sends to and expects from every
//      rank), so each knows the sizes of all the blocks its host moves;
//   2. inside the host, local rank m receives from every local rank the blocks meant for the
//      remote ranks it forwards to, and that rank's block for m itself (its own into the
//      output, the others into a stage);
//   3. across hosts, m sends each remote rank it forwards to the L blocks of its host's ranks
//      back to back on one stream, and receives from one forwarder on every other host
//      straight into the output. Steps 2 and 3 overlap (Comm::run_lanes): its own blocks
//      leave at once, each staged one as soon as it arrived.
// Every block's header carries both directions of its pair of ranks, source and final
// destination, as in the pairwise exchange: `len` what it holds, `count` what its source
// expects back (the forwarder has both from step 1). The destination checks both before
// a payload byte lands, so a pair that disagrees fails with Mismatch on both of its ranks
// (naming the other), after every other block arrived; no rank waits for a block that never
// comes, nothing is written past a block.
#include <algorithm>
#include <cstring>

#include "algorithms/algorithms.h"

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

bool twolevel_a2a_fits(const Comm& c, const Coll&) { return c.hierarchical(); }

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
  auto size_of = [&](int h) { return static_cast<int>(t.hosts[h].size()); };
  // forwards[q]: the remote ranks that local position q forwards to, host by host.
  std::vector<std::vector<int>> forwards(per_host);
  for (int q = 0; q < per_host; q++)
    for (int h = 0; h < hosts; h++)
      for (int p = q; h != h0 && p < size_of(h); p += per_host) forwards[q].push_back(t.hosts[h][p]);
  const std::vector<int>& mine = forwards[m];
  size_t most = 0;
  for (const auto& f : forwards) most = std::max(most, f.size());

  // 1. The splits of every local rank.
  const HostSplits split = gather_splits(c, op);

  // The stage: for each remote rank i this rank forwards to and each local source l, the
  // block l sends to it.
  auto staged_at = [&](size_t i, int l) { return i * per_host + l; };
  std::vector<size_t> stage_off(mine.size() * per_host + 1, 0);
  for (size_t i = 0; i < mine.size(); i++)
    for (int l = 0; l < per_host; l++) {
      const size_t at = staged_at(i, l);
      stage_off[at + 1] = stage_off[at] + (l != m ? split.sends(t.hosts[h0][l])[mine[i]] * e : 0);
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

  // 2. Inside the host, one local peer a step (step s: to m+s, from m-s): m+s gets its own
  // block and those for the ranks it forwards to; m-s's arrive the same way. The own block
  // goes first on each stream.
  int host_done = 0;  // steps of phase 2 finished
  StepsOf host(2 * static_cast<int>(1 + most), [&, s = 0, own = 0](Transfer* ts) mutable {
    if (s > 0) disagreed.note(ts[own], t.hosts[h0][mod(m - s, per_host)]);
    host_done = s;
    if (++s >= per_host) return 0;
    const int pt = mod(m + s, per_host), pf = mod(m - s, per_host);
    const int to = t.hosts[h0][pt], from = t.hosts[h0][pf];
    int k = 0;
    ts[k++] = c.send_to(to, op.send + sdisp[to], sends[to] * e, block_header(me, to));
    for (int dst : forwards[pt]) ts[k++] = c.send_to(to, op.send + sdisp[dst], sends[dst] * e, block_header(me, dst));
    own = k;
    ts[k] = c.recv_from(from, op.recv + rdisp[from], expects[from] * e, expected_header(from));
    ts[k++].check = Transfer::Check::SPLITS;
    for (size_t i = 0; i < mine.size(); i++) {
      const size_t at = staged_at(i, pf);
      ts[k++] = c.recv_from(from, stage + stage_off[at], stage_off[at + 1] - stage_off[at],
                            block_header(from, mine[i]));
    }
    return k;
  });
  // 3. Across hosts, to every remote rank this one forwards to, the blocks of local sources
  // m, m-1, m-2, ... in turn: this rank's own at once, each staged one as soon as phase 2
  // brought it, so the network works while the host does. Each receives them in that order.
  StepsOf out(static_cast<int>(std::max<size_t>(mine.size(), 1)), [&, j = -1](Transfer* ts) mutable {
    if (mine.empty() || j + 1 >= per_host) return 0;
    if (j + 1 > host_done) return static_cast<int>(Steps::kWait);
    const int l = mod(m - ++j, per_host), src = t.hosts[h0][l];
    for (size_t i = 0; i < mine.size(); i++) {
      const int to = mine[i];
      const char* buf = j == 0 ? op.send + sdisp[to] : stage + stage_off[staged_at(i, l)];
      ts[i] = c.send_to(to, buf, split.sends(src)[to] * e, block_header(src, to));
    }
    return static_cast<int>(mine.size());
  });
  // From every other host h, its forwarder to this rank (position m mod L_h) sends the blocks
  // of its sources in its own order: step j brings the block of position (m mod L_h) - j.
  StepsOf in(std::max(hosts - 1, 1), [&, j = 0, sources = std::vector<int>()](Transfer* ts) mutable {
    for (size_t i = 0; i < sources.size(); i++) disagreed.note(ts[i], sources[i]);
    sources.clear();
    for (int h = 0; h < hosts; h++) {
      if (h == h0 || j >= size_of(h)) continue;
      const int f = m % size_of(h), src = t.hosts[h][mod(f - j, size_of(h))];
      ts[sources.size()] = c.recv_from(t.hosts[h][f], op.recv + rdisp[src], expects[src] * e, expected_header(src));
      ts[sources.size()].check = Transfer::Check::SPLITS;
      sources.push_back(src);
    }
    j++;
    return static_cast<int>(sources.size());  // 0 once j passed every other host's size
  });
  // The host lane uses the local channels, the other two the remote ones, one direction each.
  Steps* lanes[] = {&host, &out, &in};
  c.run_lanes(lanes, 3);
  disagreed.raise();
}

}  // namespace comm
