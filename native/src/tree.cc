// Binomial-tree broadcast and reduce: log2(n) rounds, so they win at small sizes; chunked
// so that large messages flow down (or up) the tree as a pipeline.
#include <cstring>

#include "algorithms.h"
#include "topology.h"

namespace comm {

// Over a Group, op.root is a position in it; the tree's positions map to ranks through g.
void tree_broadcast(Comm& c, const Group& g, const Coll& op) {
  const BinomialTree t(g.me, g.size(), op.root);
  const size_t step = chunk_elems(c.opt.chunk_bytes, op.elem);
  const WireHeader h = op.header(0);
  std::vector<Transfer> ts;
  for (size_t off = 0; off < op.count; off += step) {
    const size_t bytes = std::min(step, op.count - off) * op.elem;
    char* chunk = op.recv + off * op.elem;
    if (t.parent >= 0) {
      Transfer in = c.recv_from(g.at(t.parent), chunk, bytes, h);
      c.run(&in, 1);
    }
    ts.clear();
    for (int child : t.children) ts.push_back(c.send_to(g.at(child), chunk, bytes, h));
    c.run(ts.data(), ts.size());
  }
}

// Every node folds in its children's partial results (smallest subtree first: it is ready
// soonest) and passes one chunk up; only the root writes the output buffer.
void tree_reduce(Comm& c, const Group& g, const Coll& op) {
  const BinomialTree t(g.me, g.size(), op.root);
  const size_t step = chunk_elems(c.opt.chunk_bytes, op.elem);
  const WireHeader h = op.header(0);
  char* tmp = c.scratch(0, step * op.elem);
  char* acc_chunk = t.parent >= 0 ? c.scratch(1, step * op.elem) : nullptr;
  for (size_t off = 0; off < op.count; off += step) {
    const size_t n = std::min(step, op.count - off), bytes = n * op.elem;
    const char* mine = op.send + off * op.elem;
    char* acc = acc_chunk ? acc_chunk : op.recv + off * op.elem;
    const char* left = mine;
    for (auto child = t.children.rbegin(); child != t.children.rend(); ++child) {
      Transfer in = c.recv_from(g.at(*child), tmp, bytes, h);
      c.run(&in, 1);
      op.reduce(acc, left, tmp, n);
      left = acc;
    }
    if (left != acc) std::memcpy(acc, mine, bytes);
    if (t.parent >= 0) {
      Transfer out = c.send_to(g.at(t.parent), acc, bytes, h);
      c.run(&out, 1);
    }
  }
}

void tree_broadcast(Comm& c, const Coll& op) { tree_broadcast(c, c.world, op); }
void tree_reduce(Comm& c, const Coll& op) { tree_reduce(c, c.world, op); }

void tree_all_reduce(Comm& c, const Coll& op) {
  Coll reduce = op;
  reduce.root = 0;
  // Non-roots reduce into their own output too: the broadcast then overwrites it.
  tree_reduce(c, reduce);
  Coll bcast = reduce;
  bcast.send = op.recv;
  tree_broadcast(c, bcast);
}

}  // namespace comm
