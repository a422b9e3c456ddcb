// A posted operation as the engine sees it, shared by the collective queue, the p2p
// engine and the Python request object (which waits on it).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "core/common.h"

namespace comm {

class Comm;
class Engine;
struct Coll;
using AlgorithmFn = void (*)(Comm&, const Coll&);

struct OpArgs {
  OpKind kind;
  DType dtype;
  ReduceOp op;
  double scale;
  uintptr_t send;
  uint64_t send_bytes;  // the size of the memory at `send`: no access goes past it
  uintptr_t recv;
  uint64_t recv_bytes;
  uint64_t count;
  int root;
  int peer;
  int tag;
  std::vector<uint64_t> send_counts;
  std::vector<uint64_t> recv_counts;
  // Set by Engine::prepare for a persistent collective: the algorithm chosen once.
  AlgorithmFn algo = nullptr;
  const char* algo_name = "";
  // The wire format of a compressed all_reduce, reduce_scatter, all_gather or v form (comm/compress.py;
  // twolevel_compress.cc): EXACT for every other operation; fp8's scale block in elements.
  Wire wire = Wire::EXACT;
  uint64_t wire_block = 0;
};

// The engine's own guard, run before an operation touches memory: the op, dtype and kind
// codes are in range, roots and peers are ranks of the group, and every count, split and
// offset stays inside the sizes the caller handed over with the pointers (validate.cc).
// Throws INVALID_ARGUMENT.
void check_codes(int kind, int dtype, int op);
void validate(const OpArgs& a, int rank, int size);
// validate's one check, in either form: AT_LEAST, the engine's guard (no access past the
// buffers); EXACT, the binding's lean path (buffers of exactly the operation's sizes, sharing
// no memory but in the in-place layout: anything else is the communicator's to name).
enum class Fit { AT_LEAST, EXACT };
void check_op(const OpArgs& a, int rank, int size, Fit fit);

// A posted operation; shared by the engine and the Python request object.
class Op {
 public:
  explicit Op(OpArgs a) : args(std::move(a)) {}
  const OpArgs args;
  // A queued collective: the engine whose queue holds it (its wait runs queued collectives on
  // the waiting thread, Engine::wait), and when the progress thread may take it instead
  // (stamped when that thread first sees it; Engine::kUnseen before, kEager: at once).
  // Null for send / recv, which P2P progresses.
  Engine* engine = nullptr;
  Clock::time_point due{};
  // A receive: the rank its message came from (args.peer, or the sender matched by a receive
  // from any rank). Written before finish(), read after test() / wait() saw it done.
  int source = -1;
  bool test() const { return done_.load(std::memory_order_acquire); }
  // Waits up to timeout_s (< 0: no limit); throws the op's error, or TIMEOUT. A queued
  // collective is run on this thread when its turn comes before the progress thread's.
  void wait(double timeout_s);
  void finish(std::optional<CommError> error);
  // Back to posted, for Engine::repost: only while done and held by nobody else.
  void rearm() {
    error_.reset();
    source = -1;
    done_.store(false, std::memory_order_relaxed);
  }
  void rethrow() const;

 private:
  std::atomic<bool> done_{false};
  std::optional<CommError> error_;
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace comm
