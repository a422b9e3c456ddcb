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
#include <algorithm>
#include <string>

#include "algorithms/algorithms.h"

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

// Who rank r's algorithms reach (directed; the caller makes it symmetric), for one topology.
class Planner {
 public:
  Planner(const Topology& t, int n, bool two_level, bool flat)
      : t_(t), n_(n), hosts_(static_cast<int>(t.hosts.size())), two_level_(two_level), flat_(flat),
        host_of_(n), pos_(n), world_(n) {
    for (int h = 0; h < hosts_; h++)
      for (size_t q = 0; q < t.hosts[h].size(); q++) host_of_[t.hosts[h][q]] = h, pos_[t.hosts[h][q]] = static_cast<int>(q);
    if (two_level && t.every_host_shared())
      for (int h = 0; h < hosts_; h++) owner_.push_back(shard_owners(t, h, n));
    for (int r = 0; r < n; r++) world_[r] = r;
    for (int h = 0; h < hosts_; h++) leaders_.push_back(t.hosts[h][0]);  // rank 0 leads host 0
  }

  void plan_of(int r, std::vector<char>& out) {
    const int h = host_of_[r], q = pos_[r], per_host = static_cast<int>(t_.hosts[h].size());
    for (int x : t_.hosts[h]) out[x] = 1;
    if (flat_) group_partners(world_, r, out);
    else out[mod(r + 1, n_)] = out[mod(r - 1, n_)] = 1;  // the ring of the v-collectives
    if (!two_level_) return;
    if (t_.uniform()) {
      cross_.clear();
      for (int k = 0; k < hosts_; k++) cross_.push_back(t_.hosts[k][q]);
      group_partners(cross_, h, out);
    }
    if (q == 0) group_partners(leaders_, h, out);
    for (int k = 0; k < hosts_; k++) {
      if (k == h) continue;
      const int there = static_cast<int>(t_.hosts[k].size());
      for (int p = q; p < there; p += per_host) out[t_.hosts[k][p]] = 1;  // forwards to
      out[t_.hosts[k][q % there]] = 1;                                   // its forwarder here
      if (!owner_.empty()) out[t_.hosts[k][owner_[k][r]]] = 1;
    }
  }

 private:
  const Topology& t_;
  const int n_, hosts_;
  const bool two_level_, flat_;
  std::vector<int> host_of_, pos_, world_, cross_, leaders_;
  std::vector<std::vector<int>> owner_;  // owner_[h][r]: the local position on h owning r's block
};

}  // namespace

std::vector<int> planned_peers(const Comm& c) {
  Planner planner(c.topo, c.size, c.hierarchical(), !c.hierarchical() || !c.opt.algo.empty());
  std::vector<char> mine(c.size, 0), theirs(c.size, 0);
  planner.plan_of(c.rank, mine);
  for (int r = 0; r < c.size; r++) {  // the relation made symmetric
    if (r == c.rank || mine[r]) continue;
    std::fill(theirs.begin(), theirs.end(), 0);
    planner.plan_of(r, theirs);
    mine[r] = theirs[c.rank];
  }
  std::vector<int> peers;
  for (int r = 0; r < c.size; r++)
    if (r != c.rank && mine[r]) peers.push_back(r);
  return peers;
}

std::vector<std::vector<int>> planned_peers_all(const std::vector<int>& host_of, const std::string& algo) {
  const int n = static_cast<int>(host_of.size());
  const Topology t(host_of, 0);
  const bool two_level = t.spans_hosts() && t.some_host_shared();  // Comm::hierarchical()
  Planner planner(t, n, two_level, !two_level || !algo.empty());
  std::vector<std::vector<int>> peers(n);
  std::vector<char> out(n);
  for (int r = 0; r < n; r++) {
    std::fill(out.begin(), out.end(), 0);
    planner.plan_of(r, out);
    for (int p = 0; p < n; p++)
      if (out[p] && p != r) peers[r].push_back(p), peers[p].push_back(r);
  }
  for (auto& p : peers) {  // each pair was added from both ends where both plan it
    std::sort(p.begin(), p.end());
    p.erase(std::unique(p.begin(), p.end()), p.end());
  }
  return peers;
}

}  // namespace comm
