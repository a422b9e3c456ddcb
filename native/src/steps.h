// An algorithm as a sequence of steps, each a few transfers followed by local work (the
// reduction of what arrived). Written this way, an algorithm runs alone (run_steps) or
// interleaved with another one that uses other channels (Comm::run_lanes): the two-level
// all_reduce overlaps the network phase of one segment with the shared-memory phases of
// its neighbours without a second copy of the ring.
#pragma once

#include "channel.h"

namespace comm {

class Comm;

// The most transfers one step posts (a ring step: one send, one receive).
constexpr int kMaxStepTransfers = 2;

class Steps {
 public:
  static constexpr int kWait = -1;
  virtual ~Steps() = default;
  // Called first, then each time the previous step's transfers have completed: finishes that
  // step (reduces what arrived), then writes the next step's transfers into ts and returns
  // how many (at most kMaxStepTransfers); 0 when the algorithm is done, kWait when the next
  // step waits for another lane (run_lanes asks again once some lane moved on).
  virtual int next(Transfer* ts) = 0;
};

// Runs `s` to its end on this thread (it never answers kWait alone).
void run_steps(Comm& c, Steps& s);

}  // namespace comm
