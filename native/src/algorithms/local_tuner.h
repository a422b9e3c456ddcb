// Which all_reduce runs with every rank on one host, from cma's sizes on: the ring over the
// shared-memory channels or cma's single-copy reads, whichever this host runs faster now,
// as local rank 0 measures them (cma.cc's local_all_reduce runs the choice).
//
// Why measured and not a table: the two trade places with where the ranks' cores sit (the
// ring leads while two cores share their caches, cma where they do not), a virtual machine's
// cores move between the two for minutes at a time, and nothing the op or the topology says
// tells which holds. Evidence: native/TUNING.md, "all_reduce on one host".
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace comm {

class LocalTuner {
 public:
  enum Choice : uint32_t { CMA = 0, RING = 1 };

  // The sizes it chooses for: from cma's threshold (select.cc) to kMaxBytes, where the ring
  // leads while the cores share their caches. From there cma leads either way (see
  // native/TUNING.md, "all_reduce on one host").
  static constexpr size_t kMaxBytes = 8 << 20;

  // What the next all_reduce of `bytes` runs (local rank 0 asks; it tells the others).
  Choice choose(size_t bytes) {
    Class& k = classes_[size_class(bytes)];
    if (k.burst_left == 0 && (k.est[CMA] == 0 || ++k.calls % kExploreEvery == 0)) {
      k.burst = k.current == RING ? CMA : RING;   // the other, measured now and then
      k.burst_left = kBurst;
      k.burst_best = 0;
      k.bursting = true;
    }
    if (k.burst_left > 0) {
      k.burst_left--;
      return k.burst;
    }
    return k.current;
  }

  // How long that all_reduce took.
  void record(size_t bytes, Choice a, double ns) {
    Class& k = classes_[size_class(bytes)];
    const double v = ns / static_cast<double>(bytes ? bytes : 1);
    const bool warm = k.last == static_cast<int>(a);
    k.last = a;
    if (k.bursting && a == k.burst) {
      // A burst's first half is not counted: the first runs after the other algorithm are
      // cold, at up to a third of the speed of later ones (its buffers hold the caches); of
      // the rest the best, so one hiccup of the machine cannot decide. The last call of the
      // burst (burst_left 0) sets the estimate.
      if (k.burst_left < kBurst / 2) k.burst_best = k.burst_best == 0 ? v : std::min(k.burst_best, v);
      if (k.burst_left == 0) {
        k.est[a] = k.burst_best;
        k.bursting = false;
      }
    } else if (a == k.current && warm) {
      // The current choice follows its recent runs; a single slow run moves it by a
      // quarter, at most doubling its share.
      k.est[a] = k.est[a] == 0 ? v : 0.75 * k.est[a] + 0.25 * std::min(v, 2 * k.est[a]);
    }
    // The ring unless cma is clearly ahead: a margin, so noise between two close ones does
    // not flip it (where the cores do not share their caches the ring falls behind by 3-5x).
    if (k.est[CMA] > 0 && k.est[RING] > 0) k.current = k.est[RING] > kMargin * k.est[CMA] ? CMA : RING;
  }

 private:
  static constexpr uint32_t kExploreEvery = 128, kBurst = 4;
  static constexpr double kMargin = 1.25;
  static constexpr int kClasses = 48;  // one per power of two of the payload
  static int size_class(size_t bytes) {
    int c = 0;
    while (c < kClasses - 1 && (size_t{2} << c) <= bytes) c++;
    return c;
  }
  struct Class {
    double est[2] = {};                  // ns per byte; 0: not measured yet
    Choice current = RING, burst = CMA;
    uint32_t calls = 0, burst_left = 0;
    bool bursting = false;
    double burst_best = 0;
    int last = -1;                       // what the last call of this size ran
  };
  Class classes_[kClasses];
};

}  // namespace comm
