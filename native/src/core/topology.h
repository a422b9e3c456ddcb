// Rank arithmetic shared by every algorithm: groups of ranks, the hosts they sit on, ring
// neighbours, block partitions and the binomial tree. Kept in one place so algorithms agree
// on who talks to whom.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace comm {

inline int mod(int a, int n) { return ((a % n) + n) % n; }

// The ranks an algorithm runs over, in the order it uses them: the whole communicator, the
// ranks of one host, or the same local rank on every host. Ring, tree and recursive doubling
// index a Group by position, so each is written once and runs over any subset.
struct Group {
  std::vector<int> ranks;  // communicator ranks
  int me = -1;             // this rank's position in `ranks`, -1 when it is not a member
  int size() const { return static_cast<int>(ranks.size()); }
  int at(int pos) const { return ranks[mod(pos, size())]; }  // the rank at a position (cyclic)
  int position(int rank) const {
    auto it = std::find(ranks.begin(), ranks.end(), rank);
    return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
  }
};

// Ranks grouped by host (the host id that decides shared memory). Hosts are numbered by
// their lowest rank, and ranks inside a host ascend: every rank derives the same groups.
struct Topology {
  std::vector<std::vector<int>> hosts;  // the ranks of each host
  int host = 0;                         // this rank's host
  Group local;                          // this host's ranks
  Group cross;                          // position local.me on every host, by host (uniform only)

  // host_of[r]: any label of rank r's host (equal labels, same host).
  Topology(const std::vector<int>& host_of, int rank) {
    std::vector<int> label_at;  // label of host index i
    for (size_t r = 0; r < host_of.size(); r++) {
      auto it = std::find(label_at.begin(), label_at.end(), host_of[r]);
      const size_t h = it - label_at.begin();
      if (it == label_at.end()) {
        label_at.push_back(host_of[r]);
        hosts.emplace_back();
      }
      hosts[h].push_back(static_cast<int>(r));
      if (static_cast<int>(r) == rank) host = static_cast<int>(h);
    }
    local.ranks = hosts[host];
    local.me = local.position(rank);
    if (uniform())
      for (size_t h = 0; h < hosts.size(); h++) cross.ranks.push_back(hosts[h][local.me]);
    cross.me = uniform() ? host : -1;
  }
  bool spans_hosts() const { return hosts.size() > 1; }
  bool some_host_shared() const {
    return std::any_of(hosts.begin(), hosts.end(), [](const auto& h) { return h.size() > 1; });
  }
  bool every_host_shared() const {
    return std::all_of(hosts.begin(), hosts.end(), [](const auto& h) { return h.size() > 1; });
  }
  // Every host holds the same number of ranks (the sharded two-level algorithms need it).
  bool uniform() const {
    return std::all_of(hosts.begin(), hosts.end(), [&](const auto& h) { return h.size() == hosts[0].size(); });
  }
  int host_of(int rank) const {
    for (size_t h = 0; h < hosts.size(); h++)
      if (std::find(hosts[h].begin(), hosts[h].end(), rank) != hosts[h].end()) return static_cast<int>(h);
    return -1;
  }
  // One rank per host, by host: the lowest, except `root` on its own host (rooted
  // collectives then need no extra hop on the root's host).
  Group leaders(int rank, int root) const {
    Group g;
    const int root_host = host_of(root);
    for (size_t h = 0; h < hosts.size(); h++) g.ranks.push_back(static_cast<int>(h) == root_host ? root : hosts[h][0]);
    g.me = g.position(rank);
    return g;
  }
  // The leader of this rank's host, as leaders() picks it.
  int leader(int root) const { return host_of(root) == host ? root : hosts[host][0]; }
};

// `count` elements split into n blocks whose sizes differ by at most one.
struct Blocks {
  size_t count;
  int n;
  size_t size(int i) const { return count / n + (static_cast<size_t>(i) < count % n ? 1 : 0); }
  size_t offset(int i) const { return count / n * i + std::min<size_t>(i, count % n); }
};

// Blocks of the sizes a v-collective's counts give, packed in rank order.
struct CountedBlocks {
  std::vector<size_t> offsets;  // n + 1 prefix sums
  explicit CountedBlocks(const std::vector<uint64_t>& counts) : offsets(counts.size() + 1, 0) {
    for (size_t i = 0; i < counts.size(); i++) offsets[i + 1] = offsets[i] + counts[i];
  }
  size_t size(int i) const { return offsets[i + 1] - offsets[i]; }
  size_t offset(int i) const { return offsets[i]; }
  size_t largest() const {
    size_t m = 0;
    for (size_t i = 0; i + 1 < offsets.size(); i++) m = std::max(m, offsets[i + 1] - offsets[i]);
    return m;
  }
};

// Binomial tree rooted at `root`: a node's subtree spans the ranks (relative to root)
// [v, v + lowest set bit of v). Children are listed largest subtree first.
struct BinomialTree {
  int parent = -1;
  std::vector<int> children;
  BinomialTree(int rank, int size, int root) {
    const int v = mod(rank - root, size);
    int mask = 1;
    while (mask < size && !(v & mask)) mask <<= 1;
    if (v != 0) parent = (v - mask + root) % size;
    for (int m = mask >> 1; m >= 1; m >>= 1)
      if (v + m < size) children.push_back((v + m + root) % size);
  }
};

// Chunks of at most `step` elements covering [0, n): for (auto c = Chunks{..}; ...)
inline size_t chunk_elems(size_t chunk_bytes, size_t elem) { return std::max<size_t>(1, chunk_bytes / elem); }

}  // namespace comm
