// Recursive doubling: log2(n) exchanges of the whole buffer with rank ^ 2^k. Latency-optimal
// for small all_reduce. A non-power-of-two group first folds its extra ranks into partners.
#include <cstring>

#include "algorithms/algorithms.h"
#include "core/topology.h"

namespace comm {

void rd_all_reduce(Comm& c, const Group& g, const Coll& op) {
  // Positions in g throughout; g.at() names the rank to talk to.
  const int n = g.size(), r = g.me;
  const size_t bytes = op.count * op.elem;
  char* out = op.recv;
  if (bytes && op.send != out) std::memcpy(out, op.send, bytes);
  char* tmp = c.scratch(0, bytes);
  const WireHeader h = op.header(0);
  int pow2 = 1;
  while (pow2 * 2 <= n) pow2 *= 2;
  const int extra = n - pow2;
  // Ranks below 2*extra pair up: the even one hands its data to the odd one and sits out.
  int vrank = r >= 2 * extra ? r - extra : (r % 2 ? r / 2 : -1);
  if (r < 2 * extra) {
    if (r % 2 == 0) {
      Transfer t = c.send_to(g.at(r + 1), out, bytes, h);
      c.run(&t, 1);
    } else {
      Transfer t = c.recv_from(g.at(r - 1), tmp, bytes, h);
      c.run(&t, 1);
      op.reduce(out, tmp, out, op.count);
    }
  }
  if (vrank >= 0) {
    for (int mask = 1; mask < pow2; mask <<= 1) {
      const int vpartner = vrank ^ mask;
      const int partner = vpartner < extra ? vpartner * 2 + 1 : vpartner + extra;
      c.sendrecv(g.at(partner), out, bytes, g.at(partner), tmp, bytes, h);
      // Lower rank's data first on both sides, so both compute bit-identical results.
      if (partner < r) op.reduce(out, tmp, out, op.count);
      else op.reduce(out, out, tmp, op.count);
    }
  }
  if (r < 2 * extra) {
    Transfer t = r % 2 ? c.send_to(g.at(r - 1), out, bytes, h) : c.recv_from(g.at(r + 1), out, bytes, h);
    c.run(&t, 1);
  }
}

// ceil(log2 n) rounds; in round k each rank signals rank + 2^k and hears from rank - 2^k.
void dissemination_barrier(Comm& c, const Group& g, const Coll& op) {
  const WireHeader h = op.header(0);
  for (int dist = 1; dist < g.size(); dist <<= 1)
    c.sendrecv(g.at(g.me + dist), nullptr, 0, g.at(g.me - dist), nullptr, 0, h);
}

void rd_all_reduce(Comm& c, const Coll& op) { rd_all_reduce(c, c.world, op); }
void dissemination_barrier(Comm& c, const Coll& op) { dissemination_barrier(c, c.world, op); }

}  // namespace comm
