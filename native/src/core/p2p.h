// Tagged send / recv, progressed independently of the collective queue (MPI semantics):
// isend / irecv never wait for each other, so any posting order of a batch completes.
//
// Each peer has one p2p stream per direction. Sends go out in posting order (per peer).
// Receives wait in per-(peer, tag) queues; an arriving message goes to the oldest receive
// of its tag, or is parked in memory when none is posted yet (up to kMaxParkedBytes in
// all; beyond that the peer's stream stalls until a matching receive is posted). Messages
// with the same (peer, tag) therefore match in order, different tags in any order.
//
// A receive from any rank (peer -1, MPI_ANY_SOURCE) waits in a per-tag queue of its own and
// takes the first message of its tag to arrive from any peer. Between a receive from any
// rank and one from a given rank, the earlier-posted receive gets a message both could take;
// messages parked before either was posted are taken in arrival order. Per (peer, tag) order
// still holds: a message is only matched when no earlier message of its (peer, tag) waits.
//
// Progress: exactly one thread at a time "drives" (moves bytes for every pending op and
// drains every peer's incoming stream): a blocking send / recv drives on the caller's
// thread (no hand-off on the latency path), anything else is driven by the p2p thread.
// Each op has its own deadline (posting time + COMM_TIMEOUT). The first failure (timeout,
// dead peer, mismatch, abort) fails every pending op and every later one: the streams are
// in an unknown state after it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/comm.h"
#include "core/op.h"

namespace comm {

struct WindowMemory;  // window.h

// One-sided messages (window.h) on the same per-peer stream as sends, so they keep its order:
// header fields root = the target's window id, seq = byte offset, tag = signal index (-1 none),
// len = payload bytes; a GET carries the bytes wanted in count; a reply says in flags why the
// target refused (kWinUnknown, kWinOutside). Codes far above OpKind's.
enum WinKind : uint8_t { kWinPut = 0xE0, kWinGet, kWinGetReply, kWinFlush, kWinFlushAck };
inline bool is_window_kind(uint8_t k) { return k >= kWinPut && k <= kWinFlushAck; }
constexpr uint8_t kWinUnknown = 1, kWinOutside = 2;

// A driver with nothing posted (it only listens for one-sided traffic) yields this long after
// the last byte moved, then sleeps until the next arrives.
constexpr auto kListenYield = std::chrono::microseconds(200);

// After a blocking caller (send / recv, flush, wait_signal) let go of the driver role, the p2p
// thread waits this long before it listens again: the application is likely to drive again at
// once (a ping-pong), and a listener asleep in poll() would wake on every message it drives.
// A put arriving meanwhile waits at most this long (or until the application drives).
constexpr auto kListenGrace = std::chrono::microseconds(200);

// Unexpected (not yet received) message bytes kept in memory, all peers together.
constexpr size_t kMaxParkedBytes = size_t{256} << 20;

class P2P {
 public:
  explicit P2P(Comm& c);
  ~P2P();
  P2P(const P2P&) = delete;
  P2P& operator=(const P2P&) = delete;

  // Posts a SEND or RECV. blocking: drives progress on this thread until the op is done,
  // then returns null (throws its error); otherwise returns the op to wait on.
  std::shared_ptr<Op> post(OpArgs a, bool blocking);
  void add_peer(int peer);  // a peer connected while running: its stream joins the sweep
  // One-sided: once a window was registered the driver drains every inbound stream even when
  // nothing is posted (a put lands without the target's application), until a failure.
  void add_window(uint32_t id, WindowMemory* w);
  void remove_window(uint32_t id);  // no byte lands in it after this returns
  // The origin's side of a put (buf, len: the source), get (the destination) or flush to
  // `peer`'s window `id`. The op ends when the put's bytes were sent, the get's arrived, the
  // flush was answered (the target answers after everything before it in the stream landed).
  // When nobody drives, the message is sent on the caller's thread at once (no wake-up of the
  // p2p thread on the latency path); what is left goes to the p2p thread, unless `waits`: the
  // caller waits for the op right after (wait()) and drives it then.
  std::shared_ptr<Op> post_window(int peer, uint8_t kind, uint32_t id, uint64_t offset, char* buf,
                                  uint64_t len, int32_t signal, bool waits = false);
  // Waits for an op of post_window() as a blocking send does: this thread drives.
  void wait(const std::shared_ptr<Op>& op);
  // Drives on this thread (as a blocking recv) until done() (called under the engine's lock,
  // also between sleep slices of at most 20 ms) or a failure; false, at once, when another
  // caller drives. Ctrl-C (INTERRUPTED) is thrown without failing the streams.
  bool drive_until(const std::function<bool()>& done);
  // The first failure of send / recv / one-sided traffic, thrown (nothing when none).
  void check_broken();
  void wake();  // abort: the driver notices at once instead of after its sleep slice
  void stop();  // close: fail what is pending with CLOSED and join the thread

 private:
  struct Pending {
    std::shared_ptr<Op> op;
    Clock::time_point deadline;
    uint64_t order = 0;  // receives: posting order, across peers
    Transfer t;          // send: the message on the wire
  };
  struct Parked {
    WireHeader hdr;
    std::vector<char> body;
    uint64_t arrival = 0;  // arrival order, across peers
  };
  using RecvQueues = std::map<int, std::deque<Pending>>;  // by tag
  enum class Stage { HEADER, UNDECIDED, BODY };
  struct PeerState {
    Channel* ch = nullptr;
    bool left = false;  // its stream ended after its goodbye, heard while only listening
    std::deque<Pending> sends;                 // wire order = posting order
    RecvQueues recvs;                          // posted, not yet matched, by tag
    std::map<int, std::deque<Parked>> parked;  // arrived, not yet received, by tag
    std::map<int, uint64_t> sent, received;    // per-tag message numbers (wire seq)
    // The incoming message: its header, then its body into `target` or `park`.
    Transfer in;
    Stage stage = Stage::HEADER;
    WireHeader hdr;
    std::optional<Pending> target;
    Parked park;
    // One-sided, origin side: gets and flushes sent, answered in order by the target.
    std::deque<Pending> win_gets, win_flushes;
    // Target side: the window the incoming put's body lands in (null: refused, drained into
    // `discard`), and the refusals since the last flush (kWin* bits, told in its answer).
    WindowMemory* win_put = nullptr;
    bool win_body = false;
    uint8_t refused = 0;
    uint8_t gets_refused = 0;  // origin side: refusals of gets since the last flush
    std::vector<char> discard;
  };

  void drive(std::unique_lock<std::mutex>& lock, const Op* until, const std::function<bool()>* done = nullptr);
  void release_driver();
  void finish_on_caller(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Op>& op);
  void thread_loop();
  bool pass();  // one non-blocking sweep over every peer; true if anything moved
  bool progress_sends(int peer);
  bool progress_inbound(int peer);
  void start_header(int peer);
  std::deque<Pending>* oldest_receive(int peer, int tag);  // the queue whose front takes it
  void match_parked(int peer, int tag);
  void match_parked_any(int tag);
  void deliver(int peer, int tag, std::deque<Pending>& receives);
  void accept(int peer, const WireHeader& h, const Pending& want);
  void finish(Pending& p, std::optional<CommError> error = std::nullopt);
  void fail_all(const CommError& e);
  bool left_cleanly(const CommError& e);
  // false: this thread was a sleeping listener and a caller took the driver role meanwhile.
  bool idle(std::unique_lock<std::mutex>& lock, Backoff& spins, bool caller, bool moved);
  bool stuck(const PeerState& ps) const;
  bool window_message(int peer);  // a one-sided header arrived; true when it has no body
  void window_landed(int peer);   // a put's body landed
  void queue_reply(int peer, const WireHeader& h, char* buf, uint64_t len);
  // Once this communicator had a window its streams are drained for good: a put that comes
  // after the window closed (only a peer that broke the collective close sends one) is then
  // refused and answered, instead of stalling the peer's stream until a receive is posted.
  bool listening() const { return had_window_ && !broken_ && !stopping_; }
  bool busy(const PeerState& ps) const;

  Comm& c_;
  std::vector<PeerState> peers_;
  RecvQueues any_recvs_;  // receives from any rank, by tag
  uint64_t next_order_ = 0, next_arrival_ = 0;
  std::mutex mu_;  // guards everything below; released while the driver sleeps
  std::condition_variable cv_;
  size_t pending_ = 0;  // ops posted and not finished
  size_t parked_bytes_ = 0;
  bool driving_ = false;
  bool thread_driving_ = false;  // the driver is the p2p thread (not a blocking caller)
  int handoffs_ = 0;             // blocking callers waiting for the p2p thread to hand over
  // The p2p thread only listens and sleeps in poll() / on the futex WITHOUT the driver role,
  // so a blocking caller drives at once; it takes the role back when it wakes, if still free.
  bool listener_asleep_ = false;
  // The p2p thread waits on its own condition (not cv_, which callers waiting for a hand-over
  // use), so a caller's release of the role does not wake it every time (kListenGrace).
  std::condition_variable thread_cv_;
  bool thread_timed_ = false;            // the thread waits out kListenGrace, no notify needed
  Clock::time_point last_release_{};     // when a caller last let go of the role
  bool stopping_ = false;
  std::optional<CommError> broken_;
  std::thread thread_;
  int wake_fd_ = -1;  // eventfd: a post interrupts the driver's poll()
  std::map<uint32_t, WindowMemory*> windows_;  // this rank's open windows, by id
  bool had_window_ = false;
};

}  // namespace comm
