// One-sided communication: a window of memory every rank exposes, put / get into the peers'
// windows, and signal counters (comm/window.py is the API; docs/one-sided.md the guide).
//
// How bytes move, per peer:
// - a peer on this host whose window the library allocated (window_mapped.h): the origin
//   maps that window and copies into / out of it itself (a memcpy, done when the call
//   returns; a flush is a fence), and adds to the signals as below;
// - a peer on this host with CMA (Comm::cma): the origin writes / reads the peer's window
//   itself with process_vm_writev / readv (one copy, done when the call returns), and adds
//   to the peer's signal counters in the peer's signal segment (memfd, mapped by every local
//   rank), waking it through the segment's futex word;
// - any other peer (TCP, UCX, verbs, shared memory without CMA): a message on the peer's p2p
//   stream (p2p.h, WinKind), which the TARGET's p2p driver writes into the window and counts
//   into its signals, with no help from the target's application thread. Stream order gives
//   "data, then its signal" and a flush that the target answers after everything before it
//   landed. The target checks window id, offset, length and signal index again;
// - a peer of a net with RMA (UCX or verbs with COMM_WINDOW_RMA=1, rma.h): the origin's net
//   writes and reads the peer's registered memory (window_ucx.cc, window_verbs.cc); a signal
//   waits until that completed, then goes as the message above.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "core/comm.h"
#include "core/p2p.h"
#include "windows/rma.h"
#include "windows/window_mapped.h"

namespace comm {

// A rank's signal counters, in a memfd segment local peers map: a futex word first.
struct SignalHeader {
  std::atomic<uint32_t> bell;      // bumped after every increment: the futex word
  std::atomic<uint32_t> sleeping;  // waiters (about to be) asleep on it
};
constexpr size_t kSignalHeaderBytes = 64;

// Adds 1 to counter k of the segment at `seg` and wakes its waiters (any process).
void add_signal(char* seg, uint32_t k);

// What the target's p2p driver needs of a window (its own, registered by id).
struct WindowMemory {
  char* base;
  uint64_t size;
  uint32_t signals;
  char* seg;  // this rank's signal segment
};

// One rank's window as its peers know it (exchanged at creation, in rank order).
struct WindowPeer {
  uint64_t addr;
  uint64_t size;
  uint32_t id;
  int pid;
  int signal_fd;  // its signal segment, opened through /proc/<pid>/fd (same host, CMA)
};

class Window {
 public:
  // `reach` connects a peer on first use (Engine).
  Window(Comm& c, P2P& p2p, std::function<void(int)> reach, uint32_t id, uintptr_t base, uint64_t size,
         uint32_t signals);
  ~Window();
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  uint32_t id() const { return id_; }
  bool connected() const { return !peers_.empty(); }
  int ranks() const { return c_.size; }
  uint32_t signal_count() const { return mem_.signals; }
  uint64_t size_of(int peer) const { return peers_[peer].size; }  // after connect
  int signal_fd() const { return fd_; }
  // The window is this library-allocated segment (before connect): peers on this host map it.
  void adopt(std::shared_ptr<WindowSegment> segment) { segment_ = std::move(segment); }
  const std::shared_ptr<WindowSegment>& segment() const { return segment_; }
  int memory_fd() const { return segment_ ? segment_->fd() : -1; }
  // What peers need to reach this window by RMA (rma.h); empty when the net has none.
  const std::string& rma_key() const;
  // Every rank's window (collective: each rank calls it with the same lists); memory_fds:
  // every rank's memory_fd() (empty: no rank allocated its window); keys: every rank's
  // rma_key() (empty: no RMA).
  void connect(const std::vector<WindowPeer>& peers, const std::vector<int>& memory_fds = {},
               const std::vector<std::string>& keys = {});
  // How this rank reaches `peer`'s window: "self", "mapped", "cma", "rma" or "message".
  const char* path(int peer) const;
  // put / get return true when the bytes moved inside the call (mapped, CMA, this rank):
  // nothing is left to hold for a flush.
  bool put(int peer, uintptr_t src, uint64_t len, uint64_t offset, int signal);
  bool get(int peer, uintptr_t dst, uint64_t len, uint64_t offset);
  // Whether peer's puts and gets complete inside the call (no engine, no message).
  bool moves_in_call(int peer) const { return peer == c_.rank || maps_.base(peer) || direct(peer); }
  void flush(int peer, double timeout_s);  // peer -1: every peer
  // flush without waiting: true when nothing to `peer` (-1: all) is in flight on the message
  // path, after the fence that completes mapped puts; false: flush() must wait.
  bool flush_in_call(int peer);
  void wait_signal(uint32_t k, uint64_t value, double timeout_s);
  uint64_t signal(uint32_t k) const;
  void close();

 private:
  bool direct(int peer) const;  // same host, CMA: the origin copies itself
  bool rma(int peer) const;     // the net reaches the peer's memory (rma_)
  void check_open(const char* op) const;
  RmaWait rma_wait(double timeout_s);
  void mapped_flush();  // the fence of a flush, and a look for dead peers now and then
  void check_args(const char* op, int peer, uint64_t len, uint64_t offset) const;
  [[noreturn]] void copy_failed(const char* op, int peer);
  Comm& c_;
  P2P& p2p_;
  std::function<void(int)> reach_;
  const uint32_t id_;
  WindowMemory mem_;
  int fd_ = -1;
  size_t seg_bytes_ = 0;
  std::vector<WindowPeer> peers_;
  std::vector<char*> peer_segs_;  // mapped signal segments of direct peers
  bool any_direct_ = false;       // some peer adds to the signals itself (not a message)
  std::unique_ptr<RmaWindow> rma_;  // this window registered with the net, if it has RMA
  std::shared_ptr<WindowSegment> segment_;  // this rank's memory, when the library allocated it
  PeerMappings maps_;                       // local peers' allocated windows
  Clock::time_point alive_checked_{};       // mapped_flush's last look for dead peers
  std::vector<char> dirty_;       // peers with message-path operations since their last flush
  std::mutex mu_;                 // dirty_ and close against the operations
  bool closed_ = false;
};

}  // namespace comm
