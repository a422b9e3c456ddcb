// The peers this rank's collectives exchange data with, from the topology alone (every rank
// computes the same relation, so both ends of each pair agree): what a transport connects at
// set-up when it connects on demand. Written next to the algorithms, from what each one
// reaches (change an algorithm's partners, change this):
//   ring.cc, vcoll.cc      ring neighbours (position +-1) of the group it runs over
//   tree.cc                binomial parents and children for every root: position +-2^k
//   rd.cc                  recursive doubling's partners; dissemination: position +-2^k
//   direct.cc, cma.cc,     every rank of this host (shared memory)
//   a2a.cc
//   twolevel.cc            this host; the same local position on every host (uniform);
//                          the hosts' lowest ranks (leaders of root 0); the owner of this
//                          rank's block on every other host (reduce_scatter / all_gather)
//   twolevel_a2a.cc        local position q <-> positions q, q+L, ... of every other host
// Flat algorithms run over every rank only where no two-level row fits (one host, or one
// rank per host) or COMM_ALGO forces a choice. Not planned, reached on first use (Comm::reach):
// the leaders of a root other than 0 (twolevel broadcast / reduce), and the algorithms that
// talk to every rank (pairwise all_to_all, linear gather / scatter).
#include "algorithms.h"

namespace comm {

namespace {

// Position distance 2^k (both ways) and recursive doubling's partners, in group g.
void group_partners(const std::vector<int>& g, int me, std::vector<char>& out) {
  const int n = static_cast<int>(g.size());
  if (n < 2 || me < 0) return;
  for (int d = 1; d < n; d <<= 1) out[g[mod(me + d, n)]] = out[g[mod(me - d, n)]] = 1;
  int pow2 = 1;
  while (pow2 * 2 <= n) pow2 *= 2;
  const int extra = n - pow2;
  if (me < 2 * extra) out[g[me % 2 ? me - 1 : me + 1]] = 1;
  const int v = me >= 2 * extra ? me - extra : (me % 2 ? me / 2 : -1);
  if (v >= 0)
    for (int mask = 1; mask < pow2; mask <<= 1) {
      const int vp = v ^ mask;
      out[g[vp < extra ? vp * 2 + 1 : vp + extra]] = 1;
    }
}

}  // namespace

std::vector<int> planned_peers(const Comm& c) {
  const Topology& t = c.topo;
  const int n = c.size, hosts = static_cast<int>(t.hosts.size());
  std::vector<int> host_of(n), pos(n);
  for (int h = 0; h < hosts; h++)
    for (size_t q = 0; q < t.hosts[h].size(); q++) host_of[t.hosts[h][q]] = h, pos[t.hosts[h][q]] = static_cast<int>(q);
  const bool two_level = c.hierarchical();
  const bool flat = !two_level || !c.opt.algo.empty();
  std::vector<std::vector<int>> owner;  // owner[h][r]: the local position on h owning r's block
  if (two_level && t.every_host_shared())
    for (int h = 0; h < hosts; h++) owner.push_back(shard_owners(t, h, n));
  std::vector<int> world(n), cross, leaders;
  for (int r = 0; r < n; r++) world[r] = r;
  for (int h = 0; h < hosts; h++) leaders.push_back(t.hosts[h][0]);  // rank 0 leads host 0

  auto plan_of = [&](int r, std::vector<char>& out) {
    const int h = host_of[r], q = pos[r], per_host = static_cast<int>(t.hosts[h].size());
    for (int x : t.hosts[h]) out[x] = 1;
    if (flat) group_partners(world, r, out);
    else out[mod(r + 1, n)] = out[mod(r - 1, n)] = 1;  // the ring of the v-collectives
    if (!two_level) return;
    if (t.uniform()) {
      cross.clear();
      for (int k = 0; k < hosts; k++) cross.push_back(t.hosts[k][q]);
      group_partners(cross, h, out);
    }
    if (q == 0) group_partners(leaders, h, out);
    for (int k = 0; k < hosts; k++) {
      if (k == h) continue;
      const int there = static_cast<int>(t.hosts[k].size());
      for (int p = q; p < there; p += per_host) out[t.hosts[k][p]] = 1;  // forwards to
      out[t.hosts[k][q % there]] = 1;                                   // its forwarder here
      if (!owner.empty()) out[t.hosts[k][owner[k][r]]] = 1;
    }
  };
  std::vector<char> mine(n, 0), theirs(n, 0);
  plan_of(c.rank, mine);
  for (int r = 0; r < n; r++) {  // the relation made symmetric
    if (r == c.rank || mine[r]) continue;
    std::fill(theirs.begin(), theirs.end(), 0);
    plan_of(r, theirs);
    mine[r] = theirs[c.rank];
  }
  std::vector<int> peers;
  for (int r = 0; r < n; r++)
    if (r != c.rank && mine[r]) peers.push_back(r);
  return peers;
}

}  // namespace comm
