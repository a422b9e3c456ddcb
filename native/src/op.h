// A posted operation as the engine sees it, shared by the collective queue, the p2p
// engine and the Python request object (which waits on it).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "common.h"

namespace comm {

struct OpArgs {
  OpKind kind;
  DType dtype;
  ReduceOp op;
  double scale;
  uintptr_t send;
  uintptr_t recv;
  uint64_t count;
  int root;
  int peer;
  int tag;
  std::vector<uint64_t> send_counts;
  std::vector<uint64_t> recv_counts;
};

// A posted operation; shared by the engine and the Python request object.
class Op {
 public:
  explicit Op(OpArgs a) : args(std::move(a)) {}
  const OpArgs args;
  bool test() const { return done_.load(std::memory_order_acquire); }
  // Waits up to timeout_s (< 0: no limit); throws the op's error, or TIMEOUT.
  void wait(double timeout_s);
  void finish(std::optional<CommError> error);
  void rethrow() const;

 private:
  std::atomic<bool> done_{false};
  std::optional<CommError> error_;
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace comm
