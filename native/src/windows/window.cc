#include "windows/window.h"

#include <sched.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "channels/shm/memfd.h"

namespace comm {

namespace {

SignalHeader* header(char* seg) { return reinterpret_cast<SignalHeader*>(seg); }
std::atomic<uint64_t>* counter(char* seg, uint32_t k) {
  return reinterpret_cast<std::atomic<uint64_t>*>(seg + kSignalHeaderBytes) + k;
}

std::string who(int peer) { return "rank " + std::to_string(peer); }

}  // namespace

void add_signal(char* seg, uint32_t k) {
  counter(seg, k)->fetch_add(1, std::memory_order_release);
  SignalHeader* h = header(seg);
  h->bell.fetch_add(1, std::memory_order_release);
  // Pairs with the waiter's fence: either we see it asleep, or it sees the new count.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (h->sleeping.load(std::memory_order_relaxed))  // not FUTEX_PRIVATE: shared between processes
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->bell), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

Window::Window(Comm& c, P2P& p2p, std::function<void(int)> reach, uint32_t id, uintptr_t base,
               uint64_t size, uint32_t signals)
    : c_(c), p2p_(p2p), reach_(std::move(reach)), id_(id),
      mem_{reinterpret_cast<char*>(base), size, signals, nullptr}, dirty_(c.size, 0) {
  // The counters live in a memfd so local peers can map them (and add to them) without a
  // message; nothing named is left behind whatever way the job ends (as ShmDomain).
  seg_bytes_ = kSignalHeaderBytes + sizeof(uint64_t) * signals;
  // Reserved as every segment is (a peer's add_signal must not SIGBUS), though it is small.
  MemfdOptions o;
  o.reserve = true;
  const Memfd m = create_memfd("comm-window", seg_bytes_, o,
                               "allocating the window signal segment of " + std::to_string(seg_bytes_) + " bytes");
  fd_ = m.fd;
  mem_.seg = m.base;
  // Registered before any peer learns of it, as below; a net without RMA, or memory it cannot
  // register, leaves rma_ null: messages then.
  if (c_.net) rma_ = c_.net->rma_window(RmaMemory{mem_.base, size});
  // Open to puts before any peer learns of it (a peer may put as soon as its exchange ends).
  try {
    p2p_.add_window(id_, &mem_);
  } catch (...) {
    munmap(mem_.seg, seg_bytes_);
    ::close(fd_);
    throw;
  }
}

Window::~Window() {
  try {
    close();
  } catch (...) {
  }
  for (char* s : peer_segs_)
    if (s) munmap(s, seg_bytes_);  // every segment has this rank's size (connect checks)
  if (mem_.seg) munmap(mem_.seg, seg_bytes_);
  if (fd_ >= 0) ::close(fd_);
}

bool Window::direct(int peer) const {
  return c_.cma && c_.shm && peer != c_.rank && c_.shm->local_index(peer) >= 0;
}

bool Window::rma(int peer) const {
  return rma_ && peer != c_.rank && !maps_.base(peer) && !direct(peer) && rma_->reaches(peer);
}

const std::string& Window::rma_key() const {
  static const std::string none;
  return rma_ ? rma_->key() : none;
}

const char* Window::path(int peer) const {
  if (peer == c_.rank) return "self";
  return maps_.base(peer) ? "mapped" : direct(peer) ? "cma" : rma(peer) ? "rma" : "message";
}

void Window::connect(const std::vector<WindowPeer>& peers, const std::vector<int>& memory_fds,
                     const std::vector<std::string>& keys) {
  if (peers.size() != static_cast<size_t>(c_.size) || (!keys.empty() && keys.size() != peers.size()))
    fail(ErrorCode::INVALID_ARGUMENT, -1, "window: one entry per rank expected");
  if (rma_) rma_->connect(keys);  // no keys: no peer is reached by RMA
  peers_ = peers;
  maps_.map(c_, peers, memory_fds);
  peer_segs_.assign(c_.size, nullptr);
  // Local peers map an allocated window of this rank and add to its signals themselves.
  if (segment_ && c_.shm && c_.shm->local_size() > 1) any_direct_ = true;
  for (int p = 0; p < c_.size; p++) {
    if (!direct(p) && !maps_.base(p)) continue;
    any_direct_ = true;
    // Exactly this rank's size: the counters' layout follows from the signal count.
    PeerMemfd seg{p, peers[p].pid, peers[p].signal_fd, "window signals", seg_bytes_};
    seg.mismatch = ErrorCode::INVALID_ARGUMENT;
    seg.mismatch_hint = " (ranks asked for different signal counts?)";
    peer_segs_[p] = map_peer_memfd(seg).base;
  }
}

// An RMA completion is waited for as a blocking recv waits: this thread drives the p2p engine
// (whose channels progress the net's worker; one thread in it at a time), until done(), a
// failure of the engine, a dead or aborted peer, Ctrl-C or the bound (TIMEOUT).
RmaWait Window::rma_wait(double timeout_s) {
  Deadline dl;
  dl.at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  return [this, dl](const std::function<bool()>& done) {
    auto finished = [&] { return done() || Clock::now() >= dl.at; };
    while (!done()) {
      if (!p2p_.drive_until(finished)) sched_yield();  // another caller drives: it progresses
      p2p_.check_broken();
      c_.check_alive(dl);  // TIMEOUT once the bound passed
      check_signals();
    }
  };
}

void Window::check_open(const char* op) const {
  if (closed_) fail(ErrorCode::CLOSED, -1, std::string(op) + ": the window is closed");
  if (peers_.empty()) fail(ErrorCode::INVALID_ARGUMENT, -1, std::string(op) + ": the window is not connected");
  if (c_.aborted.load()) fail(ErrorCode::ABORTED, -1, "the communicator was aborted");
}

// The engine's own guard (the Python layer checked already): nothing outside a window moves.
void Window::check_args(const char* op, int peer, uint64_t len, uint64_t offset) const {
  if (peer < 0 || peer >= c_.size)
    fail(ErrorCode::INVALID_ARGUMENT, -1, std::string(op) + ": no rank " + std::to_string(peer));
  const uint64_t size = peers_[peer].size;
  if (offset > size || len > size - offset)
    fail(ErrorCode::INVALID_ARGUMENT, peer, std::string(op) + ": " + std::to_string(len) + " bytes at offset " +
                                                std::to_string(offset) + " do not fit " + who(peer) +
                                                "'s window of " + std::to_string(size) + " bytes");
}

void Window::copy_failed(const char* op, int peer) {
  const int err = errno;
  c_.check_alive();  // a peer that died says so, rather than "cannot write"
  fail(ErrorCode::PEER_FAILURE, peer, std::string(op) + ": cannot reach " + who(peer) + "'s window memory (" +
                                          (err ? std::strerror(err) : "short copy") + ")");
}

bool Window::put(int peer, uintptr_t src, uint64_t len, uint64_t offset, int signal) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("put");
  check_args("put", peer, len, offset);
  if (signal >= static_cast<int>(mem_.signals))
    fail(ErrorCode::INVALID_ARGUMENT, -1, "put: no signal " + std::to_string(signal));
  const char* from = reinterpret_cast<const char*>(src);
  if (peer == c_.rank) {
    if (len) std::memmove(mem_.base + offset, from, len);
    if (signal >= 0) add_signal(mem_.seg, static_cast<uint32_t>(signal));
    return true;
  }
  if (char* mapped = maps_.base(peer)) {
    // memmove: src may be a view of that very window (this process maps it too)
    if (len) std::memmove(mapped + offset, from, len);
    // add_signal's release orders the data before the count: the target's acquire sees both
    if (signal >= 0) add_signal(peer_segs_[peer], static_cast<uint32_t>(signal));
    return true;
  }
  if (direct(peer)) {
    if (len && !write_process(peers_[peer].pid, peers_[peer].addr + offset, from, len)) copy_failed("put", peer);
    if (signal >= 0) add_signal(peer_segs_[peer], static_cast<uint32_t>(signal));
    return true;
  }
  if (!c_.peers[peer].p2p && reach_) reach_(peer);  // connected on first use
  if (rma(peer)) {
    bool added;
    try {
      added = rma_->put(peer, from, len, offset, signal, rma_wait(c_.opt.timeout_s));
    } catch (const CommError&) {
      c_.check_alive();  // a peer that died says so, rather than the fabric's timeout
      throw;
    }
    if (added || signal < 0) return false;
    len = 0;  // its data landed: the signal follows as a message, which the target counts in
  }
  p2p_.post_window(peer, kWinPut, peers_[peer].id, offset, const_cast<char*>(from), len, signal);
  dirty_[peer] = 1;
  return false;
}

bool Window::get(int peer, uintptr_t dst, uint64_t len, uint64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("get");
  check_args("get", peer, len, offset);
  char* to = reinterpret_cast<char*>(dst);
  if (peer == c_.rank) {
    if (len) std::memmove(to, mem_.base + offset, len);
    return true;
  }
  if (const char* mapped = maps_.base(peer)) {
    // pairs with the release of the signal that announced these bytes, if any
    std::atomic_thread_fence(std::memory_order_acquire);
    if (len) std::memmove(to, mapped + offset, len);
    return true;
  }
  if (direct(peer)) {
    if (len && !read_process(peers_[peer].pid, peers_[peer].addr + offset, to, len)) copy_failed("get", peer);
    return true;
  }
  if (!c_.peers[peer].p2p && reach_) reach_(peer);
  if (rma(peer)) {
    try {
      rma_->get(peer, to, len, offset, rma_wait(c_.opt.timeout_s));
    } catch (const CommError&) {
      c_.check_alive();  // a peer that died says so, rather than the fabric's error
      throw;
    }
    return false;
  }
  p2p_.post_window(peer, kWinGet, peers_[peer].id, offset, to, len, -1);
  dirty_[peer] = 1;
  return false;
}

// A mapped put is complete when its stores are visible: the fence makes them so before
// anything this rank does next (a send, a store the target polls). A store into a dead
// peer's mapping cannot fail, so the flush looks for dead peers, at most every few ms
// (check_alive reads every monitor: a system call per peer).
void Window::mapped_flush() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const auto now = Clock::now();
  if (now - alive_checked_ < std::chrono::milliseconds(5)) return;
  alive_checked_ = now;
  const Deadline never;
  c_.check_alive(never);
}

bool Window::flush_in_call(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  check_open("flush");
  if (peer < -1 || peer >= c_.size) fail(ErrorCode::INVALID_ARGUMENT, -1, "flush: no rank " + std::to_string(peer));
  for (int p = peer < 0 ? 0 : peer; p < (peer < 0 ? c_.size : peer + 1); p++)
    if (dirty_[p]) return false;
  if (rma_ && !rma_->flushed(peer)) return false;  // flush() waits for the net
  if (maps_.any() && (peer < 0 || maps_.base(peer))) mapped_flush();
  return true;
}

void Window::flush(int peer, double timeout_s) {
  std::vector<std::pair<int, std::shared_ptr<Op>>> answers;
  const bool drives = timeout_s >= c_.opt.timeout_s;  // this thread drives the answers (below)
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_open("flush");
    if (maps_.any() && (peer < 0 || maps_.base(peer))) mapped_flush();
    for (int p = peer < 0 ? 0 : peer; p < (peer < 0 ? c_.size : peer + 1); p++) {
      if (!dirty_[p]) continue;  // direct peers and self: every copy ended in its call
      answers.push_back({p, p2p_.post_window(p, kWinFlush, peers_[p].id, 0, nullptr, 0, -1, drives)});
      dirty_[p] = 0;
    }
  }
  if (rma_) {
    // After the messages were posted: both kinds complete together.
    try {
      rma_->flush(peer, rma_wait(timeout_s));
    } catch (const CommError& e) {
      c_.check_alive();  // a peer that died says so, rather than the fabric's timeout
      if (e.code == ErrorCode::TIMEOUT)
        fail(ErrorCode::TIMEOUT, peer, "flush: RMA to " + (peer < 0 ? std::string("the peers") : who(peer)) +
                                           " did not complete within " + std::to_string(timeout_s) +
                                           " s (COMM_TIMEOUT): a peer is hung, or its engine cannot progress");
      throw;
    }
  }
  for (auto& [p, op] : answers) {
    try {
      if (!drives) op->wait(timeout_s);  // a shorter bound than the ops' own
      else p2p_.wait(op);  // this thread drives, as a blocking send does
    } catch (const CommError& e) {
      if (e.code == ErrorCode::TIMEOUT)
        fail(ErrorCode::TIMEOUT, p, "flush: " + who(p) + " did not answer within " + std::to_string(timeout_s) +
                                        " s (COMM_TIMEOUT): it is hung, or its engine cannot progress");
      throw;
    }
  }
}

void Window::wait_signal(uint32_t k, uint64_t value, double timeout_s) {
  if (k >= mem_.signals) fail(ErrorCode::INVALID_ARGUMENT, -1, "wait_signal: no signal " + std::to_string(k));
  std::atomic<uint64_t>* ctr = counter(mem_.seg, k);
  if (ctr->load(std::memory_order_acquire) >= value) return;
  // The usual discipline: spin (the signal is a core away), yield, then sleep on the futex in
  // slices that notice abort, dead peers, failures of the p2p driver, Ctrl-C and the timeout.
  const auto start = Clock::now();
  Deadline dl;
  dl.at = timeout_s < 0 ? Clock::time_point::max()
                        : start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  auto timed_out = [&] {
    fail(ErrorCode::TIMEOUT, -1, "signal " + std::to_string(k) + " is at " + std::to_string(ctr->load()) +
                                     ", not yet " + std::to_string(value) + ", after " + std::to_string(timeout_s) +
                                     " s");
  };
  if (!any_direct_ && c_.size > 1) {
    // Every signal comes as a message the p2p driver counts in: this thread drives, as a
    // blocking recv does, instead of sleeping until the p2p thread wakes, counts and wakes it
    // (see native/TUNING.md, "One-sided and send / recv: the caller's thread drives").
    // (A direct peer's signal wakes only the futex below, not a driver asleep in poll().)
    auto done = [&] {
      return ctr->load(std::memory_order_acquire) >= value || closed_ || Clock::now() >= dl.at;
    };
    while (p2p_.drive_until(done)) {
      if (ctr->load(std::memory_order_acquire) >= value) return;
      p2p_.check_broken();
      if (closed_) fail(ErrorCode::CLOSED, -1, "wait_signal: the window is closed");
      if (Clock::now() >= dl.at) timed_out();
    }
    // Another thread of this rank drives: wait for its counting as below.
  }
  for (int i = 1; i <= 4000; i++) {
    if (ctr->load(std::memory_order_acquire) >= value) return;
    // A yield now and then, as Comm::idle: where the signalling peer shares this core (an
    // oversubscribed host), it runs now rather than after the whole spin.
    if (i % 128 == 0) sched_yield();
#if defined(__x86_64__)
    else __builtin_ia32_pause();
#endif
  }
  SignalHeader* h = header(mem_.seg);
  auto signals_checked = start;
  for (;;) {
    if (ctr->load(std::memory_order_acquire) >= value) return;
    const auto now = Clock::now();
    if (now - start < std::chrono::microseconds(200)) {
      sched_yield();
      continue;
    }
    if (now >= dl.at) timed_out();
    if (closed_) fail(ErrorCode::CLOSED, -1, "wait_signal: the window is closed");
    p2p_.check_broken();
    c_.check_alive(dl);
    if (now - signals_checked >= kSignalSlice) {
      signals_checked = now;
      check_signals();
    }
    const uint32_t bell = h->bell.load(std::memory_order_acquire);
    h->sleeping.fetch_add(1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (ctr->load(std::memory_order_acquire) < value) {
      const int ms = dl.ms_left(20);
      timespec ts{ms / 1000, (ms % 1000) * 1000000L};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&h->bell), FUTEX_WAIT, bell, &ts, nullptr, 0);
    }
    h->sleeping.fetch_sub(1, std::memory_order_relaxed);
  }
}

uint64_t Window::signal(uint32_t k) const {
  if (k >= mem_.signals) fail(ErrorCode::INVALID_ARGUMENT, -1, "signal: no signal " + std::to_string(k));
  return counter(mem_.seg, k)->load(std::memory_order_acquire);
}

void Window::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  closed_ = true;
  maps_.unmap();      // no write from this rank into any peer's window after close
  segment_.reset();   // this rank's memory goes with the last numpy array over it
  p2p_.remove_window(id_);  // a put arriving later names an unknown window: refused, never written
  if (rma_) rma_->close();  // its keys reach nothing after this
}

}  // namespace comm
