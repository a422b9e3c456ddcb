// Rank arithmetic shared by every algorithm: ring neighbours, block partitions and the
// binomial tree. Kept in one place so algorithms agree on who talks to whom.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace comm {

inline int mod(int a, int n) { return ((a % n) + n) % n; }

// `count` elements split into n blocks whose sizes differ by at most one.
struct Blocks {
  size_t count;
  int n;
  size_t size(int i) const { return count / n + (static_cast<size_t>(i) < count % n ? 1 : 0); }
  size_t offset(int i) const { return count / n * i + std::min<size_t>(i, count % n); }
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
