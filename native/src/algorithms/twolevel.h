// The segment pipeline the two-level collectives share (twolevel.cc, twolevel_compress.cc):
// a host lane over shared memory and a network lane, each segment's phases in order.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "algorithms/algorithms.h"
#include "core/topology.h"

namespace comm {

// `count` elements in n blocks of whole `unit`s (as even as whole units allow; the last
// non-empty block holds the remainder): the compressed all_reduce cuts at multiples of the
// fp8 scale block so that every block of the caller's buffer keeps one scale.
inline CountedBlocks unit_blocks(size_t count, int n, size_t unit) {
  const Blocks units{(count + unit - 1) / unit, n};
  std::vector<uint64_t> counts(n);
  for (int i = 0; i < n; i++)
    counts[i] = std::min(count, (units.offset(i) + units.size(i)) * unit) - std::min(count, units.offset(i) * unit);
  return CountedBlocks(counts);
}

// The sharded collectives in segments, so that their phases overlap. Two lanes (run_lanes):
// the host's, over shared memory, runs RS0, RS1, AG0, RS2, AG1, ..., AG(P-1) (RSk: the
// reduce-scatter of segment k inside the host; AGk its all-gather), in this one order on
// every local rank, since the shared-memory streams carry them in turn; the network's runs
// X0 ... X(P-1) (Xk: segment k of this rank's share with the same local rank of every
// host). Xk starts once RSk is done, AGk once Xk is. While Xk crosses the link, RS(k+1)
// and AG(k-1) run inside the host, so the slower of the two (the link, when it is the
// bound) sets the time instead of their sum. all_reduce has all three phases,
// reduce_scatter RS and X, all_gather X and AG. Every header carries the whole op's
// signature, so ranks that called different sizes fail at the first transfer.
class TwoLevelPipeline {
 public:
  enum Phase { RS, X, AG };

  // `bytes`: the size of the whole exchange (an all_reduce's input), which sets the segments;
  // segments start at multiples of `unit` elements.
  TwoLevelPipeline(Comm& c, const Coll& op, size_t count, size_t bytes, bool has_rs, bool has_ag, size_t unit = 1,
                   size_t most = kMaxSegments)
      : c_(c), op_(op), t_(c.topo), segs_(unit_blocks(count, segments(bytes, most), unit)), has_rs_(has_rs) {
    const int p = segments(bytes, most);
    if (has_rs) host_.items.push_back({RS, 0});
    for (int k = 0; k < p; k++) {
      if (has_rs && k + 1 < p) host_.items.push_back({RS, k + 1});
      if (has_ag) host_.items.push_back({AG, k});
      net_.items.push_back({X, k});
    }
  }
  virtual ~TwoLevelPipeline() = default;

  void run() {
    Steps* lanes[] = {&host_, &net_};
    c_.run_lanes(lanes, 2);
  }

 protected:
  virtual std::unique_ptr<Steps> start(Phase phase, int seg) = 0;
  virtual void finished(Phase, int) {}
  virtual int width() const { return 2; }  // the most transfers a phase's step posts

  Comm& c_;
  const Coll& op_;
  const Topology& t_;
  const CountedBlocks segs_;

 private:
  // Up to 4 segments of at least 4 MiB: the first RS and the last AG are the phases not
  // hidden behind the link, a quarter of the host's work at 4 segments. More segments hide
  // more but cost a step round trip each and cut the network phase into short transfers
  // (see native/TUNING.md, "Two-level segments").
  static constexpr size_t kSegmentBytes = 4 << 20;
  static constexpr size_t kMaxSegments = 4;
  static int segments(size_t bytes, size_t most) {
    return static_cast<int>(std::clamp<size_t>(bytes / kSegmentBytes, 1, most));
  }

  struct Item {
    Phase phase;
    int seg;
  };
  class Lane final : public Steps {
   public:
    explicit Lane(TwoLevelPipeline& p) : p_(p) {}
    std::vector<Item> items;
    int width() const override { return std::max(2, p_.width()); }
    int next(Transfer* ts) override {
      for (;;) {
        if (cur_) {
          if (const int k = cur_->next(ts)) return k;
          cur_.reset();
          p_.finished(items[i_].phase, items[i_].seg);
          p_.done_[items[i_++].phase]++;
        }
        if (i_ == items.size()) return 0;
        if (!p_.ready(items[i_])) return kWait;
        cur_ = p_.start(items[i_].phase, items[i_].seg);
      }
    }

   private:
    TwoLevelPipeline& p_;
    size_t i_ = 0;
    std::unique_ptr<Steps> cur_;
  };

  // Each lane finishes its segments in order, so a count of finished ones says which are.
  bool ready(const Item& it) const {
    if (it.phase == RS || (it.phase == X && !has_rs_)) return true;
    return done_[it.phase == X ? RS : X] > it.seg;
  }

  const bool has_rs_;
  int done_[3] = {};
  Lane host_{*this}, net_{*this};
};

// One algorithm after the other.
class Then final : public Steps {
 public:
  Then(std::unique_ptr<Steps> a, std::unique_ptr<Steps> b) : a_(std::move(a)), b_(std::move(b)) {}
  int next(Transfer* ts) override {
    if (a_) {
      if (const int k = a_->next(ts)) return k;
      a_.reset();
    }
    return b_->next(ts);
  }

 private:
  std::unique_ptr<Steps> a_, b_;
};

}  // namespace comm
