// The state one communicator's algorithms run against: who the peers are, how to reach
// them, and the one waiting discipline every algorithm uses (spin, yield, then sleep on a
// futex or poll), bounded by the operation's deadline, abort, and peer liveness.
#pragma once

#include <poll.h>
#include <sched.h>

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <mutex>
#include <string>
#include <vector>

#include "channels/channel.h"
#include "algorithms/local_tuner.h"
#include "channels/net.h"
#include "kernels/reduce.h"
#include "channels/shm/shm.h"
#include "core/steps.h"
#include "core/topology.h"

namespace comm {

// Progress of one wait: reset it whenever something moved.
struct Backoff {
  int calls = 0;
  Clock::time_point start;
  Clock::time_point checked;          // the last full liveness check (monitor sockets, deadline)
  Clock::time_point signals_checked;  // the last check_signals()
};

struct Options {
  double timeout_s = 300;
  std::string algo;               // COMM_ALGO: forced algorithm name, empty = automatic
  size_t chunk_bytes = 512 << 10; // pipelining unit of ring / tree
  size_t direct_max_bytes = 16 << 10;  // largest per-rank payload of the slot (copy) path
};

struct Peer {
  std::unique_ptr<Channel> coll;  // collective traffic
  std::unique_ptr<Channel> p2p;   // send / recv traffic (own stream: tags match out of order)
  // Carries no data: readable means gone ('B'ye on close, 'A' on abort, 'R' on revoke,
  // 'F' + the rank whose loss failed the peer's operation).
  // Atomic: a peer connected on first use is registered while other threads watch the rest.
  std::atomic<int> monitor_fd{-1};
  // What the monitor said last (under alive_mu_): 0 nothing, 'B', 'A', 'R', or 'D' for a
  // hang-up without a word (the process died). Kept so dead_peers() and check_alive() agree.
  char heard = 0;
  // Atomic: the collective thread and the p2p driver both watch the monitor sockets.
  std::atomic<bool> said_goodbye{false};
};

// One collective as the algorithms see it (pointers already resolved, op already mapped).
struct Coll {
  OpKind kind;
  DType dtype;
  ReduceOp op;        // as on the wire (for the header)
  ReduceFn reduce;    // SUM kernel for AVG / PREMUL_SUM
  const char* send;
  char* recv;
  size_t count;       // elements, per the contract's convention of `kind`
  int root;
  const std::vector<uint64_t>* send_counts;
  const std::vector<uint64_t>* recv_counts;
  uint64_t seq;
  size_t elem;        // itemsize
  Wire wire;          // EXACT, or a compressed collective's format (twolevel_compress.cc)
  size_t wire_block;  // fp8: elements per scale
  WireHeader header(size_t len) const;
};

class Comm {
 public:
  Comm(int rank, int size, Options opt);
  ~Comm();

  const int rank;
  const int size;
  const Options opt;
  const Group world;  // every rank, in rank order
  Topology topo;      // one host until the bootstrap says where every rank is (Engine::set_hosts)
  std::unique_ptr<Net> net;  // the fabric the peers' channels run on, if not shm / TCP
  std::vector<Peer> peers;   // after `net`: destroyed first, their channels use it
  std::unique_ptr<ShmDomain> shm;  // null when no other rank shares this host (or tcp-only)
  bool cma = false;                // every local rank can process_vm_readv every other
  Deadline deadline;
  std::atomic<bool> aborted{false};
  uint64_t coll_seq = 0;
  LocalTuner tuner;             // local rank 0's measurements (local_all_reduce)
  const char* ran = nullptr;    // set by an algorithm that runs one of several it chose itself

  // True when every rank of the group is on this host (shared-memory-only algorithms).
  bool all_local() const { return shm && shm->local_size() == size; }
  // The communicator spans hosts and some host holds several ranks: two levels pay.
  bool hierarchical() const { return topo.spans_hosts() && topo.some_host_shared(); }

  // Drive the transfers until all complete. Transfers on the same channel and direction
  // proceed in the order given (that order is the stream order on the wire). When it
  // throws, every incomplete transfer has been abandoned (Channel::abandon).
  void run(Transfer* ts, size_t n);
  Transfer send_to(int peer, const void* buf, size_t len, const WireHeader& h) const;
  Transfer recv_from(int peer, void* buf, size_t len, const WireHeader& h) const;
  // The collective channel to `peer`, connected now (through `connector`) if it is not yet;
  // a clear SYSTEM error where no connection exists and none can be made.
  Channel* reach(int peer) const;
  // Set by a transport that connects peers on first use: returns once `peer` is registered
  // (register_peer), or throws CommError. Runs on the thread of the operation that needs it.
  std::function<void(int)> connector;
  mutable std::atomic<int> connected_on_demand{0};  // peers `reach` had to connect
  // Hands a connected peer to the communicator; safe while operations run (a peer connected
  // on first use). The channels are in place before the monitor is watched.
  void register_peer(int peer, int monitor_fd, std::unique_ptr<Channel> coll, std::unique_ptr<Channel> p2p);
  // Convenience: one send and one receive at once (ring steps, pairwise exchange).
  void sendrecv(int to, const void* sbuf, size_t slen, int from, void* rbuf, size_t rlen,
                const WireHeader& h);
  // Runs several algorithms at once, each step of each as soon as its previous one finished
  // (steps.h). No two lanes may use one channel in the same direction: only then is the
  // order of each stream on the wire the same on both of its ends whatever the timing.
  static constexpr int kMaxLanes = 3;
  void run_lanes(Steps* const* lanes, int n);

  // Direct (all-local) rounds: publish that this rank reached `round`, then wait until
  // every local rank has. Round r uses publication slot r % 2 (see algorithms/README.md).
  uint64_t begin_round() { return ++round_; }
  void publish_round(uint64_t round);
  void wait_round(uint64_t round);

  // One step of the wait discipline: spin (the peer is running on another core), then
  // sched_yield (give a core we share to whoever needs it), then sleep on the futex or
  // poll(). The phases are timed from the start of the wait: a wake-up from a futex costs
  // tens of microseconds on a busy machine, so sleeping only starts once the peer is
  // clearly not about to answer. `ready` is re-checked right before sleeping so a wake-up
  // cannot be lost; `fds` are polled instead of the futex when a socket is involved.
  // `dl` is the deadline of the wait: the collective one unless the caller (p2p) has its own.
  // `spin` false skips the spinning: a socket transfer is pending beside shared-memory ones,
  // and the kernel's network work needs the cores. The thresholds' evidence:
  // native/TUNING.md, "Waiting: spin, yield, sleep".
  template <class Ready>
  void idle(Backoff& b, Ready ready, const std::vector<pollfd>* fds = nullptr,
            const Deadline* dl = nullptr, bool spin = true) {
    if (!dl) dl = &deadline;
    if (b.calls++ == 0) b.start = b.checked = b.signals_checked = Clock::now();
    if ((b.calls & 255) == 0) check_alive(*dl);
    // Only sockets pending (no shared-memory transfer marked by a trailing -1): poll() wakes
    // as soon as the kernel has bytes, so spinning and yielding (a recv per transfer each
    // time) would only take the cores that the network stack and the peers need. Except
    // for small transfers (`spin`, see wait_on): their answer is a round trip away, less
    // than poll()'s sleep and wake-up, so they are driven for kSocketSpin first (only up to
    // kSocketSpinMaxBytes: larger ones would take the cores the peers need).
    const bool sockets_only = fds && !fds->empty() && fds->back().fd >= 0;
    if (spin && b.calls < spin_calls_ && !sockets_only) {
      // Every kYieldEvery calls a yield: where the peer shares this core (the other core is
      // taken by another program, or the scheduler woke it here), it runs now instead of
      // after the whole spin; alone on the core, a yield costs one quick system call.
      if (b.calls % kYieldEvery == 0) sched_yield();
      else cpu_relax();
      return;
    }
    const auto now = Clock::now();
    if (sockets_only && spin && now - b.start < kSocketSpin) return;
    if (now - b.start < yield_for_ && !sockets_only) {
      sched_yield();
      return;
    }
    // Before each sleep: abort at once; the monitor sockets and the deadline (a few
    // syscalls) every kCheckEvery, since oversubscribed ranks sleep after every round.
    if (aborted.load(std::memory_order_relaxed)) fail(ErrorCode::ABORTED, -1, "the communicator was aborted");
    if (now - b.checked >= kCheckEvery) {
      check_alive(*dl);
      b.checked = now;
    }
    if (now - b.signals_checked >= kSignalSlice) {
      b.signals_checked = now;
      check_signals();
    }
    const int ms = dl->ms_left(kSleepSliceMs);
    if (fds && !fds->empty()) {
      if (!ready()) sleep_fds(*fds, ms);  // ready() also arms event-driven channels
    } else if (shm) {
      shm->sleep(ready, ms);
    }
    else sched_yield();
  }

  // Scratch memory owned by the communicator, reused across operations.
  char* scratch(int which, size_t bytes);

  // Call once shm is set: picks the spin budget from local ranks vs cores.
  void set_local_ranks_known();
  // Throws PEER_FAILURE / ABORTED / TIMEOUT (past `dl`) when waiting is pointless.
  void check_alive(const Deadline& dl);
  void check_alive() { check_alive(deadline); }
  // A channel's failure naming a peer (a UCX endpoint timeout, a reset connection) may be a
  // symptom of what the monitors say plainly: a peer died, aborted or revoked. Their word,
  // given within a short grace, replaces `e`; otherwise `e` stands.
  CommError explain(const CommError& e);
  // A shared-memory peer that said goodbye has written all it ever will: a transfer to or
  // from it that cannot move now never will. Throws PEER_FAILURE naming it (instead of
  // waiting out the timeout) when stuck() says so. Cheap until some peer said goodbye.
  // stuck() runs after the goodbye is seen: what the peer wrote before it is visible.
  template <class Stuck>
  void check_closed_peer(int peer, Stuck stuck) const {
    if (goodbyes_.load(std::memory_order_relaxed) &&
        peers[peer].said_goodbye.load(std::memory_order_acquire) && stuck())
      closed_peer(peer);
  }
  // why: 'A' (abort) or 'R' (revoke): what the peers' operations fail with.
  void abort(char why = 'A');
  // Peers whose process died, first hand (their monitor hung up without a word): what this
  // rank knows of failures before the survivors agree on them (shrink). Never throws.
  std::vector<int> dead_peers();
  void say_goodbye();  // before a clean close: peers will not mistake it for a crash
  // After this rank's operation failed because `e.peer` is gone: tell every connected peer
  // (once per lost rank), so ranks that were not waiting on the lost one directly fail now,
  // not at their timeout. Each peer that hears it first tells its own peers (the watcher):
  // the word floods the connection graph, which holds the flat ring, so it reaches every
  // rank, including ranks never connected to the lost one.
  void relay_failure(const CommError& e);
  // A rank this one knows is gone (first hand or from a peer), or -1: what a connection being
  // made on first use checks so it does not wait out the timeout for a dead peer.
  int first_lost();
  // The watcher: a thread that reads the monitors while no operation does, so a rank that is
  // idle or blocked elsewhere still passes deaths, hearsay and revokes on (liveness.cc).
  void watch_start();
  void watch_stop();
  void release();      // close every connection and unmap shared memory
  void close_channels();  // the peers' channels only (the monitor sockets stay)
  // In a forked child: close this process's copies of the connections and mappings
  // without touching what the parent shares (no goodbye, no shutdown).
  void forget();

 private:
  static constexpr int kSleepSliceMs = 20;  // abort and peer death are noticed this fast
  static constexpr auto kSocketSpin = std::chrono::microseconds(50);
  static constexpr int kYieldEvery = 128;  // spinning calls between two yields
  static constexpr size_t kSocketSpinMaxBytes = 8 << 10;  // "small" for kSocketSpin
  static constexpr auto kCheckEvery = std::chrono::milliseconds(2);
  static void cpu_relax() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }
  void drive(Transfer* ts, size_t n);  // run() without the clean-up on failure
  // One progress pass over the transfers (each behind an earlier one of its stream waits);
  // true if a byte moved. Clears *all_done while some transfer is incomplete.
  bool progress_pass(Transfer* ts, size_t n, bool* all_done);
  // Nothing moved: one step of idle() on the transfers' channels, then the closed-peer checks.
  void wait_on(Transfer* ts, size_t n, Backoff& spins, std::vector<pollfd>& fds);
  void sleep_fds(const std::vector<pollfd>& fds, int ms);
  char hear(Peer& p, int32_t* lost, int from);
  void relay_lost(int lost);                 // alive_mu_ held
  void send_all(const char* msg, size_t n);  // to every connected peer that has not left
  void watch_loop();
  void watch_wake();
  // Hearsay: the first rank a peer said was lost, and that peer (under alive_mu_; sticky).
  int lost_ = -1, lost_via_ = -1;
  std::vector<char> relayed_lost_;  // ranks whose loss this rank has passed on (alive_mu_)
  bool relayed_revoke_ = false;     // alive_mu_
  std::unique_ptr<std::thread> watcher_;  // a pointer: a forked child leaks the parent's
  int watch_fd_ = -1;  // eventfd: a new peer or the end of the watch
  std::atomic<bool> watching_{false};
  [[noreturn]] void closed_peer(int peer) const;
  std::atomic<int> goodbyes_{0};  // peers whose 'B'ye check_alive has read
  // Spinning only pays when every local rank has a core; oversubscribed ranks spin briefly
  // (set_local_ranks_known).
  int spin_calls_ = 2000;
  Clock::duration yield_for_ = std::chrono::milliseconds(2);
  uint64_t round_ = 0;
  std::mutex alive_mu_;  // one reader of the monitor sockets at a time (two threads wait)
  struct Scratch {
    std::unique_ptr<char[]> data;
    size_t bytes = 0;
  };
  std::vector<Scratch> scratch_;
};

}  // namespace comm
