// Binomial-tree broadcast and reduce: log2(n) rounds, so they win at small sizes; chunked
// so that large messages flow down (or up) the tree as a pipeline.
#include <cstring>

#include "algorithms/algorithms.h"
#include "core/topology.h"

namespace comm {

// Over a Group, op.root is a position in it; the tree's positions map to ranks through g.
TreeChunks::TreeChunks(Comm& c, const Group& g, const Coll& op)
    : c(c), g(g), op(op), tree(g.me, g.size(), op.root), step(chunk_elems(c.opt.chunk_bytes, op.elem)),
      chunks(static_cast<int>((op.count + step - 1) / step)), h(op.header(0)) {}

TreeBroadcast::TreeBroadcast(Comm& c, const Group& g, const Coll& op, const TreeBroadcast* feed)
    : t_(c, g, op), feed_(feed) {}

int TreeBroadcast::have() const {
  if (t_.tree.parent >= 0) return received_;
  return feed_ ? feed_->have() : t_.chunks;
}

int TreeBroadcast::next(Transfer* ts) {
  // The previous step's transfers are complete.
  if (recv_posted_) received_++, recv_posted_ = false;
  if (send_posted_) sent_++, send_posted_ = false;
  const bool receiving = t_.tree.parent >= 0 && received_ < t_.chunks;
  const bool sending = !t_.tree.children.empty() && sent_ < t_.chunks;
  if (!receiving && !sending) return 0;
  auto chunk = [&](int k) { return t_.op.recv + t_.offset(k); };
  auto bytes = [&](int k) { return t_.elems(k) * t_.op.elem; };
  int n = 0;
  if (receiving) {
    ts[n++] = t_.c.recv_from(t_.g.at(t_.tree.parent), chunk(received_), bytes(received_), t_.h);
    recv_posted_ = true;
  }
  if (sending && sent_ < have()) {
    for (int child : t_.tree.children) ts[n++] = t_.c.send_to(t_.g.at(child), chunk(sent_), bytes(sent_), t_.h);
    send_posted_ = true;
  }
  return n ? n : kWait;  // only a fed root waits: for its feed's next chunk
}

void tree_broadcast(Comm& c, const Group& g, const Coll& op) {
  TreeBroadcast steps(c, g, op);
  run_steps(c, steps);
}

// Every node folds in its children's partial results (smallest subtree first: it is ready
// soonest) and passes one chunk up; only the root writes the output buffer.
TreeReduce::TreeReduce(Comm& c, const Group& g, const Coll& op, char* tmp, char* acc, const TreeReduce* feed)
    : t_(c, g, op), tmp_(tmp), acc_(acc), feed_(feed) {}

int TreeReduce::next(Transfer* ts) {
  const Coll& op = t_.op;
  const BinomialTree& tree = t_.tree;
  for (;;) {
    const size_t n = t_.elems(done_), bytes = n * op.elem;
    char* acc = tree.parent >= 0 ? acc_ : op.recv + t_.offset(done_);
    const Posted was = posted_;
    posted_ = Posted::NONE;
    if (was == Posted::RECV) {  // a child's partial sum of this chunk is in tmp_
      op.reduce(acc, left_, tmp_, n);
      left_ = acc;
      child_++;
    }
    if (was != Posted::SEND) {
      if (done_ == t_.chunks) return 0;
      if (!started_) {
        if (feed_ && feed_->have() <= done_) return kWait;
        left_ = op.send + t_.offset(done_);
        started_ = true;
      }
      if (child_ < tree.children.size()) {
        const int child = tree.children[tree.children.size() - 1 - child_];
        ts[0] = t_.c.recv_from(t_.g.at(child), tmp_, bytes, t_.h);
        posted_ = Posted::RECV;
        return 1;
      }
      if (left_ != acc) std::memcpy(acc, left_, bytes);
      if (tree.parent >= 0) {
        ts[0] = t_.c.send_to(t_.g.at(tree.parent), acc, bytes, t_.h);
        posted_ = Posted::SEND;
        return 1;
      }
    }
    done_++;  // this chunk went up (or, at the root, is in op.recv)
    child_ = 0;
    started_ = false;
  }
}

void tree_reduce(Comm& c, const Group& g, const Coll& op) {
  const size_t chunk = ring_chunk_bytes(c, op.elem);  // one chunk, as the ring's
  TreeReduce steps(c, g, op, c.scratch(0, chunk), g.me == op.root ? nullptr : c.scratch(1, chunk));
  run_steps(c, steps);
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
