// Binomial-tree broadcast and reduce: log2(n) rounds, so they win at small sizes; chunked
// so that large messages flow down (or up) the tree as a pipeline.
#include <cstring>

#include "algorithms.h"
#include "topology.h"

namespace comm {

// Over a Group, op.root is a position in it; the tree's positions map to ranks through g.
TreeBroadcast::TreeBroadcast(Comm& c, const Group& g, const Coll& op, const TreeBroadcast* feed)
    : c_(c), g_(g), op_(op), tree_(g.me, g.size(), op.root), step_(chunk_elems(c.opt.chunk_bytes, op.elem)),
      chunks_(static_cast<int>((op.count + step_ - 1) / step_)), h_(op.header(0)), feed_(feed) {}

int TreeBroadcast::have() const {
  if (tree_.parent >= 0) return received_;
  return feed_ ? feed_->have() : chunks_;
}

int TreeBroadcast::next(Transfer* ts) {
  // The previous step's transfers are complete.
  if (recv_posted_) received_++, recv_posted_ = false;
  if (send_posted_) sent_++, send_posted_ = false;
  const bool receiving = tree_.parent >= 0 && received_ < chunks_;
  const bool sending = !tree_.children.empty() && sent_ < chunks_;
  if (!receiving && !sending) return 0;
  auto chunk = [&](int k) { return op_.recv + k * step_ * op_.elem; };
  auto bytes = [&](int k) { return std::min(step_, op_.count - k * step_) * op_.elem; };
  int n = 0;
  if (receiving) {
    ts[n++] = c_.recv_from(g_.at(tree_.parent), chunk(received_), bytes(received_), h_);
    recv_posted_ = true;
  }
  if (sending && sent_ < have()) {
    for (int child : tree_.children) ts[n++] = c_.send_to(g_.at(child), chunk(sent_), bytes(sent_), h_);
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
    : c_(c), g_(g), op_(op), tree_(g.me, g.size(), op.root), step_(chunk_elems(c.opt.chunk_bytes, op.elem)),
      chunks_(static_cast<int>((op.count + step_ - 1) / step_)), h_(op.header(0)), tmp_(tmp), acc_(acc),
      feed_(feed) {}

int TreeReduce::next(Transfer* ts) {
  for (;;) {
    const size_t off = done_ * step_, n = std::min(step_, op_.count - std::min(off, op_.count));
    const size_t bytes = n * op_.elem;
    char* acc = tree_.parent >= 0 ? acc_ : op_.recv + off * op_.elem;
    const Posted was = posted_;
    posted_ = Posted::NONE;
    if (was == Posted::RECV) {  // a child's partial sum of this chunk is in tmp_
      op_.reduce(acc, left_, tmp_, n);
      left_ = acc;
      child_++;
    }
    if (was != Posted::SEND) {
      if (done_ == chunks_) return 0;
      if (!started_) {
        if (feed_ && feed_->have() <= done_) return kWait;
        left_ = op_.send + off * op_.elem;
        started_ = true;
      }
      if (child_ < tree_.children.size()) {
        const int child = tree_.children[tree_.children.size() - 1 - child_];
        ts[0] = c_.recv_from(g_.at(child), tmp_, bytes, h_);
        posted_ = Posted::RECV;
        return 1;
      }
      if (left_ != acc) std::memcpy(acc, left_, bytes);
      if (tree_.parent >= 0) {
        ts[0] = c_.send_to(g_.at(tree_.parent), acc, bytes, h_);
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
  const size_t chunk = chunk_elems(c.opt.chunk_bytes, op.elem) * op.elem;
  const bool root = g.me == op.root;
  TreeReduce steps(c, g, op, c.scratch(0, chunk), root ? nullptr : c.scratch(1, chunk));
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
