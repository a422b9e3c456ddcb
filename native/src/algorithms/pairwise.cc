// Personalised exchanges. all_to_all: n-1 steps, in step s rank r sends to r+s and receives
// from r-s, so every rank sends and receives exactly once per step (no hot spot).
// gather / scatter: the root talks to every rank at once.
#include <cstring>
#include <numeric>

#include "algorithms/algorithms.h"
#include "core/topology.h"

namespace comm {

void pairwise_all_to_all(Comm& c, const Coll& op) {
  const int n = c.size, r = c.rank;
  std::vector<size_t> sdisp(n + 1, 0), rdisp(n + 1, 0);
  for (int i = 0; i < n; i++) {
    sdisp[i + 1] = sdisp[i] + (*op.send_counts)[i] * op.elem;
    rdisp[i + 1] = rdisp[i] + (*op.recv_counts)[i] * op.elem;
  }
  auto sent = [&](int p) { return sdisp[p + 1] - sdisp[p]; };
  auto received = [&](int p) { return rdisp[p + 1] - rdisp[p]; };
  // validate() made the block a rank keeps the same size on both sides.
  if (sent(r)) std::memmove(op.recv + rdisp[r], op.send + sdisp[r], sent(r));
  // Every header carries both directions of its pair of ranks: `len` is what the message
  // holds, `count` the bytes its sender expects back. The receiver checks both before a
  // payload byte lands. On a disagreement the payload is drained unread and the remaining
  // steps still run, so both ranks of the pair fail with Mismatch (never a write past a
  // block, never a block silently unwritten) and no other rank waits for a step that never
  // comes.
  SplitsDisagreement disagreed;
  for (int s = 1; s < n; s++) {
    const int to = mod(r + s, n), from = mod(r - s, n);
    WireHeader out = op.header(0), in = op.header(0);
    out.count = received(to);
    in.count = sent(from);
    Transfer ts[2] = {c.send_to(to, op.send + sdisp[to], sent(to), out),
                      c.recv_from(from, op.recv + rdisp[from], received(from), in)};
    ts[1].check = Transfer::Check::SPLITS;
    c.run(ts, 2);
    disagreed.note(ts[1], from);
  }
  disagreed.raise();
}

void linear_gather(Comm& c, const Coll& op) {
  const size_t bytes = op.count * op.elem;
  const WireHeader h = op.header(0);
  if (c.rank != op.root) {
    Transfer t = c.send_to(op.root, op.send, bytes, h);
    c.run(&t, 1);
    return;
  }
  if (bytes) std::memmove(op.recv + c.rank * bytes, op.send, bytes);
  std::vector<Transfer> ts;
  for (int p = 0; p < c.size; p++)
    if (p != c.rank) ts.push_back(c.recv_from(p, op.recv + p * bytes, bytes, h));
  c.run(ts.data(), ts.size());
}

void linear_scatter(Comm& c, const Coll& op) {
  const size_t bytes = op.count * op.elem;
  const WireHeader h = op.header(0);
  if (c.rank != op.root) {
    Transfer t = c.recv_from(op.root, op.recv, bytes, h);
    c.run(&t, 1);
    return;
  }
  if (bytes) std::memmove(op.recv, op.send + c.rank * bytes, bytes);
  std::vector<Transfer> ts;
  for (int p = 0; p < c.size; p++)
    if (p != c.rank) ts.push_back(c.send_to(p, op.send + p * bytes, bytes, h));
  c.run(ts.data(), ts.size());
}

}  // namespace comm
