// Ring algorithms: reduce-scatter then all-gather, each n-1 steps to the next rank. Every
// rank sends (n-1)/n of the buffer per phase: bandwidth-optimal. Reduction is pipelined in
// chunks of opt.chunk_bytes so a step's transfer overlaps the previous chunk's reduction.
// Each runs over a Group: the whole communicator, or a subset (twolevel.cc).
#include <cstring>

#include "algorithms.h"
#include "topology.h"

namespace comm {

namespace {

// After this, the fully reduced block `g.me` of `in` is at partial(n-2, g.me).
// partial(step, block) is where the partial result of `block` after `step` is written.
template <class Layout, class Partial>
void ring_reduce_blocks(Comm& c, const Group& g, const Coll& op, const char* in, const Layout& b,
                        Partial partial) {
  const int n = g.size(), r = g.me, next = g.at(r + 1), prev = g.at(r - 1);
  const size_t step_elems = chunk_elems(c.opt.chunk_bytes, op.elem);
  char* tmp = c.scratch(0, step_elems * op.elem);
  const WireHeader h = op.header(0);
  for (int s = 0; s < n - 1; s++) {
    const int send_blk = mod(r - s - 1, n), recv_blk = mod(r - s - 2, n);
    const char* src = s == 0 ? in + b.offset(send_blk) * op.elem : partial(s - 1, send_blk);
    char* dst = partial(s, recv_blk);
    const char* mine = in + b.offset(recv_blk) * op.elem;
    const size_t ns = b.size(send_blk), nr = b.size(recv_blk);
    for (size_t off = 0; off < std::max(ns, nr); off += step_elems) {
      const size_t sl = off < ns ? std::min(step_elems, ns - off) : 0;
      const size_t rl = off < nr ? std::min(step_elems, nr - off) : 0;
      Transfer ts[2];
      int k = 0;
      if (sl) ts[k++] = c.send_to(next, src + off * op.elem, sl * op.elem, h);
      if (rl) ts[k++] = c.recv_from(prev, tmp, rl * op.elem, h);
      c.run(ts, k);
      if (rl) op.reduce(dst + off * op.elem, mine + off * op.elem, tmp, rl);
    }
  }
}

// Block `g.me` of buf is in place; afterwards every block is.
template <class Layout>
void gather_blocks(Comm& c, const Group& g, const Coll& op, char* buf, const Layout& b) {
  const int n = g.size(), r = g.me, next = g.at(r + 1), prev = g.at(r - 1);
  const WireHeader h = op.header(0);
  for (int s = 0; s < n - 1; s++) {
    const int send_blk = mod(r - s, n), recv_blk = mod(r - s - 1, n);
    c.sendrecv(next, buf + b.offset(send_blk) * op.elem, b.size(send_blk) * op.elem, prev,
               buf + b.offset(recv_blk) * op.elem, b.size(recv_blk) * op.elem, h);
  }
}

}  // namespace

void ring_reduce_to_blocks(Comm& c, const Group& g, const Coll& op, const Blocks& b) {
  char* mine = op.recv + b.offset(g.me) * op.elem;
  if (g.size() == 1) {
    if (mine != op.send + b.offset(g.me) * op.elem) std::memcpy(mine, op.send + b.offset(g.me) * op.elem, b.size(g.me) * op.elem);
    return;
  }
  // Partial sums live in the output buffer itself: no scratch beyond one chunk.
  ring_reduce_blocks(c, g, op, op.send, b, [&](int, int blk) { return op.recv + b.offset(blk) * op.elem; });
}

void ring_gather_blocks(Comm& c, const Group& g, const Coll& op, char* buf, const Blocks& b) {
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
