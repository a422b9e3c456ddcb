// One communicator of the engine: owns the Comm, runs collectives in posting order.
// A blocking collective on an idle engine runs on the caller's thread (no hand-off on the
// latency path); anything else is queued. A queued collective is run by whichever thread
// comes first: a thread waiting for it (Engine::wait runs the queue up to it on the waiting
// thread, so post + wait costs what the blocking call costs) or the progress thread, which
// takes a small one only kGrace after it first saw it queued (so an operation nobody waits
// for still completes: posting order and progress never depend on a wait) and a large one
// at once (it overlaps the caller's work). Send / recv bypass the queue: P2P progresses
// them independently (p2p.h).
#pragma once

#include <array>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "algorithms/algorithms.h"
#include "core/comm.h"
#include "core/op.h"
#include "core/p2p.h"
#include "windows/window.h"

namespace comm {

// One line of the engine's flight recorder: a collective it ran (or is running).
struct RecentOp {
  uint64_t seq;
  OpKind kind;
  DType dtype;
  uint64_t count;
  int root;
  const char* state;  // "running", "done", "failed"
  double started;     // steady clock seconds (CLOCK_MONOTONIC: Python's time.monotonic)
};

class Engine {
 public:
  Engine(int rank, int size, std::vector<int> local_ranks, Options opt);
  ~Engine();

  // Bootstrap, driven by transports/native/__init__.py in this order.
  int shm_create();  // returns the segment's descriptor, which peers open via /proc
  void shm_attach(int rank, int pid, int fd);
  bool cma_probe();              // can this rank read every local peer's memory?
  void set_cma(bool everywhere); // the AND of every rank's probe: all must choose alike
  void set_hosts(const std::vector<int>& host_of);  // every rank passes the same list
  // coll_fds empty: the peer is on this host and uses shared memory. Also after start(): a
  // peer connected on first use (any thread; its operations see it from then on).
  void add_peer(int peer, int monitor_fd, std::vector<int> coll_fds, int p2p_fd);
  // The peers the algorithms exchange data with (plan.cc); after set_hosts.
  std::vector<int> planned_peers() const { return comm::planned_peers(comm_); }
  // How peers outside that plan get connected: fn(peer) returns once add_peer(peer) was
  // called, or throws CommError. Without it, reaching such a peer is an error.
  void set_connector(std::function<void(int)> fn) { comm_.connector = std::move(fn); }
  int connected_on_demand() const { return comm_.connected_on_demand.load(); }
  int first_lost() { return comm_.first_lost(); }
  // Data over a net (net.h) instead: open it, publish the address it returns through the
  // store, then add every peer with the address it published.
  std::string open_net(const std::string& name, const NetOptions& opts);
  void add_net_peer(int peer, int monitor_fd, const std::string& address, bool same_host);
  // every_peer: each one must be connected by now (a full mesh); else peers come on demand.
  void start(bool every_peer = true);

  // One-sided (window.h): this rank's window over [base, base + size) with `signals`
  // counters; Window::connect then hands it every rank's. After start().
  std::shared_ptr<Window> window(uintptr_t base, uint64_t size, uint32_t signals);
  // Returns null when the op ran to completion on this thread (errors are thrown).
  std::shared_ptr<Op> post(OpArgs args, bool blocking);
  // A collective posted again without waiting (a persistent one's next start): `op` is done
  // and nobody else holds it, so it is re-armed instead of allocating another.
  void repost(const std::shared_ptr<Op>& op);
  // Op::wait of a queued collective: runs queued collectives on this thread, in posting
  // order, until `op` is done; spins briefly, then sleeps while another thread runs one.
  void wait(Op& op, double timeout_s);
  // A collective posted many times with the same arguments (persistent collectives): the
  // algorithm is chosen here, once; post the returned args.
  OpArgs prepare(OpArgs args);
  // The last collectives this engine ran, oldest first. Recorded here rather than in Python
  // so the lean call paths cost nothing per call for it.
  std::vector<RecentOp> recent_ops() const;
  void abort();
  // abort() that tells the peers it is a revoke: their operations fail with REVOKED.
  void revoke();
  std::vector<int> dead_peers() { return comm_.dead_peers(); }
  void close();
  // Called in a child forked from the owning process: closes the child's copies of the
  // connections so the parent's peers are unaffected and the parent's death stays visible
  // to them. Afterwards every call is refused or a no-op. The engine must then never be
  // destroyed in the child: its threads, mutexes and condition variables are the parent's
  // (a copied condition variable with waiters would hang its destructor).
  void forget_after_fork();
  const char* last_algorithm() const { return last_algorithm_; }
  bool forked() const { return forked_.load(std::memory_order_relaxed); }
  int size() const { return comm_.size; }
  int rank() const { return comm_.rank; }

 private:
  // A waiting caller's deadline, fixed at the first clock read that needs it (a wait that runs
  // its op at once thereby reads the clock once).
  struct Deadline {
    double timeout_s;            // < 0: none
    Clock::time_point end{};     // fixed by at()
    Clock::time_point at(Clock::time_point now) {
      if (end == Clock::time_point{})
        end = timeout_s < 0 ? Clock::time_point::max()
                            : now + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(timeout_s));
      return end;
    }
  };
  // The checks of every post; returns holding mu_.
  std::unique_lock<std::mutex> admit(const OpArgs& args);
  // Queues a collective (mu_ held on entry, released on return) and wakes the progress
  // thread when it must take it.
  void enqueue(const std::shared_ptr<Op>& op, bool blocking, std::unique_lock<std::mutex>& lock);
  Clock::time_point execute(Op& op, Deadline* deadline = nullptr);
  // Pops the queue's front and runs it on this thread (mu_ held on entry and on return).
  void run_front(std::unique_lock<std::mutex>& lock, Deadline* deadline);
  void run_collective(const OpArgs& a, uint64_t seq);
  Coll describe(const OpArgs& a) const;
  void progress_loop();

  Comm comm_;
  std::unique_ptr<P2P> p2p_;
  std::mutex mu_;
  std::condition_variable cv_;       // the progress thread sleeps on it
  std::condition_variable idle_cv_;  // threads waiting for an op to end (Engine::wait, close())
  std::deque<std::shared_ptr<Op>> queue_;
  std::atomic<bool> busy_{false};  // an op is running (written under mu_; read spinning)
  // Small ops are queued without a notify (saving the post a system call) while the
  // progress thread is armed: it then looks at the queue every slice_, from kGrace doubling
  // up to kSliceMax while waiters run every op before it is due (back to kGrace when one
  // waited past its due). kArmedFor after the last post it sleeps until notified, and the
  // next post notifies it.
  bool armed_ = false;
  Clock::duration slice_ = kGrace;
  uint64_t posts_ = 0;  // queued so far: the progress thread tells activity by it
  static constexpr auto kGrace = std::chrono::microseconds(200);
  static constexpr auto kSliceMax = std::chrono::milliseconds(2);
  static constexpr auto kArmedFor = std::chrono::milliseconds(20);
  static constexpr Clock::time_point kUnseen = Clock::time_point::max();  // Op::due not yet stamped
  static constexpr Clock::time_point kEager = Clock::time_point::min();   // Op::due of a large op
  // A waiter yields this long for the op another thread runs before sleeping.
  static constexpr auto kYieldFor = std::chrono::microseconds(50);
  // Up to this many bytes, an op posted asynchronously waits kGrace for its waiter to run it.
  static constexpr uint64_t kLazyMaxBytes = 64 << 10;
  bool stopping_ = false;
  bool closed_ = false;
  std::mutex peers_mu_;  // add_peer against close(): no peer is registered into a released comm
  bool released_ = false;  // peers_mu_
  std::atomic<bool> forked_{false};  // read before any lock: a copied mutex may be held
  std::optional<CommError> broken_;  // first failure: every later op fails with it
  std::thread thread_;
  const char* last_algorithm_ = "";
  static constexpr size_t kRecent = 64;
  mutable std::mutex recent_mu_;  // held briefly: the recorder is read when an op failed
  std::array<RecentOp, kRecent> recent_{};
  uint64_t recorded_ = 0;
  uint32_t windows_ = 0;  // ids handed out (mu_): a closed window's id is never reused
};

}  // namespace comm
