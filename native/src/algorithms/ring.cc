// Ring algorithms: reduce-scatter then all-gather, each n-1 steps to the next rank. Every
// rank sends (n-1)/n of the buffer per phase: bandwidth-optimal. Reduction is pipelined in
// chunks of opt.chunk_bytes so a step's transfer overlaps the previous chunk's reduction.
// Each runs over a Group: the whole communicator, or a subset (twolevel.cc).
#include <cstring>
#include <functional>
#include <memory>

#include "algorithms/algorithms.h"
#include "core/topology.h"

namespace comm {

namespace {

// After this, the fully reduced block `g.me` of `in` is at partial(n-2, g.me).
// partial(step, block) is where the partial result of `block` after `step` is written.
// Each step moves one chunk of a block (opt.chunk_bytes) and reduces it into place.
template <class Layout>
class RingReduce final : public Steps {
 public:
  using Partial = std::function<char*(int step, int block)>;
  RingReduce(Comm& c, const Group& g, const Coll& op, const char* in, Layout b, Partial partial, char* tmp)
      : op_(op), in_(in), b_(std::move(b)), partial_(std::move(partial)), tmp_(tmp), n_(g.size()), r_(g.me),
        next_(g.at(g.me + 1)), prev_(g.at(g.me - 1)), step_elems_(chunk_elems(c.opt.chunk_bytes, op.elem)),
        h_(op.header(0)), c_(c) {}

  int next(Transfer* ts) override {
    const size_t e = op_.elem;
    if (rl_) op_.reduce(dst_ + off_ * e, mine_ + off_ * e, tmp_, rl_);
    if (started_) off_ += step_elems_;
    started_ = true;
    for (; s_ < n_ - 1; s_++, off_ = 0) {
      const int send_blk = mod(r_ - s_ - 1, n_), recv_blk = mod(r_ - s_ - 2, n_);
      const size_t ns = b_.size(send_blk), nr = b_.size(recv_blk);
      if (off_ >= std::max(ns, nr)) continue;
      const char* src = s_ == 0 ? in_ + b_.offset(send_blk) * e : partial_(s_ - 1, send_blk);
      dst_ = partial_(s_, recv_blk);
      mine_ = in_ + b_.offset(recv_blk) * e;
      const size_t sl = off_ < ns ? std::min(step_elems_, ns - off_) : 0;
      rl_ = off_ < nr ? std::min(step_elems_, nr - off_) : 0;
      int k = 0;
      if (sl) ts[k++] = c_.send_to(next_, src + off_ * e, sl * e, h_);
      if (rl_) ts[k++] = c_.recv_from(prev_, tmp_, rl_ * e, h_);
      return k;
    }
    rl_ = 0;
    return 0;
  }

 private:
  const Coll op_;
  const char* in_;
  const Layout b_;
  const Partial partial_;
  char* const tmp_;
  const int n_, r_, next_, prev_;
  const size_t step_elems_;
  const WireHeader h_;
  Comm& c_;
  int s_ = 0;
  size_t off_ = 0, rl_ = 0;  // the current step's chunk offset and the elements it receives
  bool started_ = false;
  char* dst_ = nullptr;
  const char* mine_ = nullptr;
};

// Block `g.me` of buf is in place; afterwards every block is.
template <class Layout>
class RingGather final : public Steps {
 public:
  RingGather(Comm& c, const Group& g, const Coll& op, char* buf, Layout b)
      : c_(c), n_(g.size()), r_(g.me), next_(g.at(g.me + 1)), prev_(g.at(g.me - 1)), e_(op.elem), buf_(buf),
        b_(std::move(b)), h_(op.header(0)) {}

  int next(Transfer* ts) override {
    if (s_ >= n_ - 1) return 0;
    const int send_blk = mod(r_ - s_, n_), recv_blk = mod(r_ - s_ - 1, n_);
    s_++;
    ts[0] = c_.send_to(next_, buf_ + b_.offset(send_blk) * e_, b_.size(send_blk) * e_, h_);
    ts[1] = c_.recv_from(prev_, buf_ + b_.offset(recv_blk) * e_, b_.size(recv_blk) * e_, h_);
    return 2;
  }

 private:
  Comm& c_;
  const int n_, r_, next_, prev_;
  const size_t e_;
  char* const buf_;
  const Layout b_;
  const WireHeader h_;
  int s_ = 0;
};

template <class Layout>
void ring_reduce_blocks(Comm& c, const Group& g, const Coll& op, const char* in, const Layout& b,
                        typename RingReduce<Layout>::Partial partial) {
  RingReduce<Layout> steps(c, g, op, in, b, std::move(partial), c.scratch(0, ring_chunk_bytes(c, op.elem)));
  run_steps(c, steps);
}

template <class Layout>
void gather_blocks(Comm& c, const Group& g, const Coll& op, char* buf, const Layout& b) {
  RingGather<Layout> steps(c, g, op, buf, b);
  run_steps(c, steps);
}

// Partial sums live in the output buffer itself: no scratch beyond one chunk (`tmp`).
template <class Layout>
std::unique_ptr<Steps> to_blocks_steps(Comm& c, const Group& g, const Coll& op, const Layout& b, char* tmp) {
  char* recv = op.recv;
  const size_t e = op.elem;
  return std::make_unique<RingReduce<Layout>>(c, g, op, op.send, b,
                                              [recv, b, e](int, int blk) { return recv + b.offset(blk) * e; }, tmp);
}

template <class Layout>
void reduce_to_blocks(Comm& c, const Group& g, const Coll& op, const Layout& b) {
  char* mine = op.recv + b.offset(g.me) * op.elem;
  if (g.size() == 1) {
    if (mine != op.send + b.offset(g.me) * op.elem) std::memcpy(mine, op.send + b.offset(g.me) * op.elem, b.size(g.me) * op.elem);
    return;
  }
  run_steps(c, *to_blocks_steps(c, g, op, b, c.scratch(0, ring_chunk_bytes(c, op.elem))));
}

}  // namespace

std::unique_ptr<Steps> ring_reduce_to_blocks_steps(Comm& c, const Group& g, const Coll& op, const Blocks& b,
                                                   char* tmp) {
  return to_blocks_steps(c, g, op, b, tmp);
}

std::unique_ptr<Steps> ring_reduce_to_blocks_steps(Comm& c, const Group& g, const Coll& op,
                                                   const CountedBlocks& b, char* tmp) {
  return to_blocks_steps(c, g, op, b, tmp);
}

std::unique_ptr<Steps> ring_gather_blocks_steps(Comm& c, const Group& g, const Coll& op, char* buf,
                                                const CountedBlocks& b) {
  return std::make_unique<RingGather<CountedBlocks>>(c, g, op, buf, b);
}

std::unique_ptr<Steps> ring_gather_blocks_steps(Comm& c, const Group& g, const Coll& op, char* buf,
                                                const Blocks& b) {
  return std::make_unique<RingGather<Blocks>>(c, g, op, buf, b);
}

void ring_reduce_to_blocks(Comm& c, const Group& g, const Coll& op, const Blocks& b) {
  reduce_to_blocks(c, g, op, b);
}
void ring_reduce_to_blocks(Comm& c, const Group& g, const Coll& op, const CountedBlocks& b) {
  reduce_to_blocks(c, g, op, b);
}
void ring_gather_blocks(Comm& c, const Group& g, const Coll& op, char* buf, const Blocks& b) {
  gather_blocks(c, g, op, buf, b);
}
void ring_gather_blocks(Comm& c, const Group& g, const Coll& op, char* buf, const CountedBlocks& b) {
  gather_blocks(c, g, op, buf, b);
}

void ring_all_reduce(Comm& c, const Group& g, const Coll& op) {
  const Blocks b{op.count, g.size()};
  ring_reduce_to_blocks(c, g, op, b);
  ring_gather_blocks(c, g, op, op.recv, b);
}

void ring_reduce_scatter(Comm& c, const Group& g, const Coll& op) {
  const Blocks b{op.count * g.size(), g.size()};
  const size_t bytes = op.count * op.elem;
  if (g.size() == 1) {
    if (bytes && op.recv != op.send) std::memmove(op.recv, op.send, bytes);
    return;
  }
  // The output holds one block only, so partial sums alternate between two scratch blocks.
  char* partials[2] = {c.scratch(1, bytes), c.scratch(2, bytes)};
  ring_reduce_blocks(c, g, op, op.send, b, [&](int step, int) {
    return step == g.size() - 2 ? op.recv : partials[step & 1];
  });
}

void ring_all_gather(Comm& c, const Group& g, const Coll& op) {
  const size_t bytes = op.count * op.elem;
  char* mine = op.recv + g.me * bytes;
  if (bytes && op.send != mine) std::memcpy(mine, op.send, bytes);
  ring_gather_blocks(c, g, op, op.recv, Blocks{op.count * g.size(), g.size()});
}

// The v forms: the same schedules over blocks of the counts' sizes, after the check that
// every rank passed the same counts (agree_on_counts, vcoll.cc).
void ring_all_gather_v(Comm& c, const Coll& op) {
  agree_on_counts(c, op);
  const CountedBlocks b{*op.recv_counts};
  const size_t bytes = b.size(c.rank) * op.elem;
  char* mine = op.recv + b.offset(c.rank) * op.elem;
  if (bytes && op.send != mine) std::memcpy(mine, op.send, bytes);
  gather_blocks(c, c.world, op, op.recv, b);
}

void ring_reduce_scatter_v(Comm& c, const Coll& op) {
  agree_on_counts(c, op);
  const CountedBlocks b{*op.recv_counts};
  const size_t bytes = b.largest() * op.elem;
  char* partials[2] = {c.scratch(1, bytes), c.scratch(2, bytes)};
  ring_reduce_blocks(c, c.world, op, op.send, b, [&](int step, int) {
    return step == c.size - 2 ? op.recv : partials[step & 1];
  });
}

void ring_all_reduce(Comm& c, const Coll& op) { ring_all_reduce(c, c.world, op); }
void ring_reduce_scatter(Comm& c, const Coll& op) { ring_reduce_scatter(c, c.world, op); }
void ring_all_gather(Comm& c, const Coll& op) { ring_all_gather(c, c.world, op); }

}  // namespace comm
