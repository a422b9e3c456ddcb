// An algorithm as a sequence of steps, each a few transfers followed by local work (the
// reduction of what arrived). Written this way, an algorithm runs alone (run_steps) or
// interleaved with another one that uses other channels (Comm::run_lanes): the two-level
// all_reduce overlaps the network phase of one segment with the shared-memory phases of
// its neighbours without a second copy of the ring.
#pragma once

#include <utility>

#include "channels/channel.h"

namespace comm {

class Comm;

class Steps {
 public:
  static constexpr int kWait = -1;
  virtual ~Steps() = default;
  // The most transfers one step posts (a ring step: one send, one receive).
  virtual int width() const { return 2; }
  // Called first, then each time the previous step's transfers have completed (ts still
  // holds them, so their headers can be read): finishes that step (reduces what arrived),
  // then writes the next step's transfers into ts and returns how many (at most width());
  // 0 when the algorithm is done, kWait when the next step waits for another lane
  // (run_lanes asks again once some lane moved on).
  virtual int next(Transfer* ts) = 0;
};

// Steps from a function of the transfers (the algorithm's state lives in its captures).
template <class Fn>
class StepsOf final : public Steps {
 public:
  StepsOf(int width, Fn fn) : width_(width), fn_(std::move(fn)) {}
  int width() const override { return width_; }
  int next(Transfer* ts) override { return fn_(ts); }

 private:
  const int width_;
  Fn fn_;
};

// Runs `s` to its end on this thread (it never answers kWait alone).
void run_steps(Comm& c, Steps& s);

}  // namespace comm
