// Which all_reduce runs with every rank on one host, from cma's sizes on: the ring over the
// shared-memory channels or cma's single-copy reads, whichever this host runs faster now,
// as local rank 0 measures them (cma.cc's local_all_reduce runs the choice).
//
// Why measured and not a table: the two trade places with where the ranks' cores sit.
// Where two cores share their caches the ring ran 2.5-3x cma (2 ranks, 256 KiB-4 MiB: 13-16
// against 4-6 GB/s busbw), its memcpys being 4x the kernel's copies; where they do not, each
// ring copy reads lines the other core has just written and cma ran 1.5x the ring (select.cc).
// A virtual machine's cores move between the two for minutes at a time, and nothing the op or
// the topology says tells which holds.
#pragma once

#include <cstddef>
#include <cstdint>

namespace comm {

class LocalTuner {
 public:
  enum Choice : uint32_t { CMA = 0, RING = 1, kChoices = 2 };

  // What the next all_reduce of `bytes` runs (local rank 0 asks; it tells the others).
  Choice choose(size_t bytes) {
    Class& k = classes_[size_class(bytes)];
    k.calls++;
    // Each twice at first: a first run pays page faults and cold channels.
    for (uint32_t a = 0; a < kChoices; a++)
      if (k.samples[a] < 2) return static_cast<Choice>(a);
    const Choice best = k.ns_per_byte[RING] < k.ns_per_byte[CMA] ? RING : CMA;
    // Now and then the other, so a change of the machine's mood is seen (at most 1/32 of
    // the calls run the slower one).
    return k.calls % kExploreEvery == 0 ? static_cast<Choice>(1 - best) : best;
  }

  // How long that all_reduce took. The choice's estimate follows its recent runs; a run of
  // the other replaces its estimate outright (it is seldom measured, so its old value says
  // little about now).
  void record(size_t bytes, Choice a, double ns) {
    Class& k = classes_[size_class(bytes)];
    const double v = ns / static_cast<double>(bytes ? bytes : 1);
    const bool current = k.samples[a] >= 2 && a == (k.ns_per_byte[RING] < k.ns_per_byte[CMA] ? RING : CMA);
    k.ns_per_byte[a] = current ? 0.5 * k.ns_per_byte[a] + 0.5 * v : v;
    k.samples[a]++;
  }

 private:
  static constexpr uint32_t kExploreEvery = 32;
  static constexpr int kClasses = 48;  // one per power of two of the payload
  static int size_class(size_t bytes) {
    int c = 0;
    while (c < kClasses - 1 && (size_t{2} << c) <= bytes) c++;
    return c;
  }
  struct Class {
    double ns_per_byte[kChoices] = {};
    uint32_t samples[kChoices] = {};
    uint32_t calls = 0;
  };
  Class classes_[kClasses];
};

}  // namespace comm
