// A window over verbs RMA (window_verbs.h): this rank's window registered with the net's
// protection domain (ibv_reg_mr, LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ), its address, size
// and rkey published as the key (window_verbs_plan.h). put -> RDMA WRITE from a registered
// staging chunk into the peer's window; get -> RDMA READ into a staging chunk, copied out to
// the caller's buffer when it completes; flush waits until every chunk posted to the peer has
// completed (all are signaled; RC completes them in posting order), while this thread drives
// the engine, whose p2p channels poll the completions.
//
// Why staging (a copy) rather than registering the caller's buffer: as verbs.cc says of its
// slots, the engine does not track that memory past the call; a registration kept for it
// would point at freed pages once the buffer goes. 32 chunks of 128 KiB per window (4 MiB):
// a 64 MiB put streams through them, each chunk reused as soon as its WRITE completed.
//
// A signal is not an RDMA atomic: put waits until everything this rank issued to the peer
// completed, then window.cc sends the signal as a message on the same p2p stream, which the
// target's engine counts in (as UCX's windows do; rma.h). An IBV_WR_ATOMIC_FETCH_AND_ADD on
// the counter would land without waking the target's waiter (it sleeps on the engine's poll
// or a futex, neither of which an atomic touches), and where the device reports
// IBV_ATOMIC_HCA (most do) it is atomic only against other HCA atomics, not against the
// fetch_add with which local ranks (CMA, mapped windows) add to the same counters.
#include "windows/window_verbs.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "windows/window_verbs_plan.h"

namespace comm::verbs {

namespace {

constexpr uint32_t kChunks = 32, kChunkBytes = 128 << 10;

std::string who(int peer) { return "rank " + std::to_string(peer); }

const char* op_name(RmaOp op) { return op == RmaOp::WRITE ? "RDMA WRITE" : "RDMA READ"; }

}  // namespace

class VerbsRmaWindow final : public RmaWindow {
 public:
  VerbsRmaWindow(std::shared_ptr<VerbsRmaHub> hub, int rank)
      : hub_(std::move(hub)), rank_(rank), tracker_(kChunks, static_cast<int>(hub_->qps.size())) {}
  ~VerbsRmaWindow() override { close(); }

  bool open(const RmaMemory& mem);  // false: the memory cannot be registered
  const std::string& key() const override { return key_; }
  void connect(const std::vector<std::string>& keys) override;
  bool reaches(int peer) const override;
  bool put(int peer, const void* src, uint64_t len, uint64_t offset, int signal, const RmaWait& wait) override;
  void get(int peer, void* dst, uint64_t len, uint64_t offset, const RmaWait& wait) override;
  void flush(int peer, const RmaWait& wait) override;
  bool flushed(int peer) override;
  void close() override;
  // The hub's lock held for these three:
  void on_completion(int peer, const ibv_wc& wc);
  void lost(int peer) { tracker_.lost(peer, "its RDMA connection closed with work in flight"); }
  void release();

 private:
  struct Peer {
    bool known = false;
    RmaKey key;
  };
  using Lock = std::unique_lock<std::mutex>;
  void check_open(const char* op) const;
  void report(int peer, const char* op);  // throws the first failure kept for `peer` (-1: any)
  ibv_qp* room(int peer, const char* op, const RmaWait& wait, Lock& lock);
  void transfer(RmaOp op, int peer, char* local, uint64_t len, uint64_t offset, const RmaWait& wait, Lock& lock);

  std::shared_ptr<VerbsRmaHub> hub_;
  const int rank_;
  uint32_t id_ = 0;  // in the hub's windows once open
  ibv_mr* mr_ = nullptr;  // null for a window of 0 bytes
  std::unique_ptr<Region> staging_;
  std::string key_;
  std::vector<Peer> peers_;
  RmaTracker tracker_;
  bool closed_ = false;
};

bool VerbsRmaWindow::open(const RmaMemory& mem) {
  Lock lock(hub_->mu);
  if (hub_->released || hub_->next_id > kMaxRmaWindowId) return false;
  RmaKey k{reinterpret_cast<uint64_t>(mem.base), mem.size, 0};
  if (mem.size) {
    // ibv_reg_mr(3): REMOTE_WRITE requires LOCAL_WRITE. No IBV_ACCESS_RELAXED_ORDERING: the
    // target reads the data once the signal message after it arrived, which strict PCIe
    // ordering of the NIC's writes makes safe.
    mr_ = lib().reg_mr(hub_->dev->pd, mem.base, mem.size,
                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
    if (!mr_) return false;  // the destructor has nothing else to undo
    k.rkey = mr_->rkey;
  }
  try {
    // LOCAL_WRITE: a READ's response lands here.
    staging_ = std::make_unique<Region>(*hub_->dev, size_t{kChunks} * kChunkBytes, IBV_ACCESS_LOCAL_WRITE);
  } catch (const CommError&) {
    return false;  // mr_ goes with the destructor's close()
  }
  key_ = encode_rma_key(k);
  id_ = hub_->next_id++;
  hub_->windows[id_] = this;
  return true;
}

void VerbsRmaWindow::connect(const std::vector<std::string>& keys) {
  Lock lock(hub_->mu);
  if (!keys.empty() && keys.size() != hub_->qps.size())
    fail(ErrorCode::INVALID_ARGUMENT, -1, "window: one verbs key per rank expected");
  peers_.assign(keys.size(), Peer{});
  for (size_t r = 0; r < keys.size(); r++) {
    if (keys[r].empty() || static_cast<int>(r) == rank_) continue;  // no RMA window there: messages
    std::string why;
    if (!decode_rma_key(keys[r], &peers_[r].key, &why))
      fail(ErrorCode::INVALID_ARGUMENT, static_cast<int>(r), "window: a malformed verbs key from " + who(static_cast<int>(r)) + ": " + why);
    peers_[r].known = true;
  }
}

// Every peer of this net is reached over its p2p queue pair, which the engine connects on
// first use, before it calls put / get (an unconnected one fails them as a closed one).
bool VerbsRmaWindow::reaches(int peer) const {
  Lock lock(hub_->mu);
  return peer >= 0 && static_cast<size_t>(peer) < peers_.size() && peers_[peer].known;
}

void VerbsRmaWindow::check_open(const char* op) const {
  if (closed_) fail(ErrorCode::CLOSED, -1, std::string(op) + ": the window is closed");
  if (hub_->released) fail(ErrorCode::CLOSED, -1, std::string(op) + ": the communicator is closed");
}

void VerbsRmaWindow::report(int peer, const char* op) {
  int which = -1;
  const std::string why = tracker_.take_error(peer, &which);
  if (!why.empty()) fail(ErrorCode::PEER_FAILURE, which, std::string(op) + ": RMA to " + who(which) + " failed (" + why + ")");
}

// Waits (the hub's lock released) until a staging chunk is free and the queue pair to `peer`
// has room for one more RMA work request; returns that queue pair.
ibv_qp* VerbsRmaWindow::room(int peer, const char* op, const RmaWait& wait, Lock& lock) {
  for (;;) {
    check_open(op);
    report(peer, op);
    ibv_qp* qp = hub_->qps[peer];
    if (!qp) fail(ErrorCode::PEER_FAILURE, peer, std::string(op) + ": no RDMA connection to " + who(peer) + " (closed)");
    if (tracker_.has_free() && hub_->busy[peer] < VerbsRmaHub::kDepth) return qp;
    lock.unlock();
    wait([&] {
      Lock l(hub_->mu);
      return closed_ || hub_->released || !hub_->qps[peer] || tracker_.has_error(peer) ||
             (tracker_.has_free() && hub_->busy[peer] < VerbsRmaHub::kDepth);
    });
    lock.lock();
  }
}

// One work request per chunk, each signaled (the QP also has sq_sig_all): its completion
// frees the chunk, and a READ's is when its bytes are copied out.
void VerbsRmaWindow::transfer(RmaOp op, int peer, char* local, uint64_t len, uint64_t offset, const RmaWait& wait,
                              Lock& lock) {
  const char* name = op == RmaOp::WRITE ? "put" : "get";
  check_open(name);
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size() || !peers_[peer].known)
    fail(ErrorCode::INVALID_ARGUMENT, peer, std::string(name) + ": " + who(peer) + " has no verbs window key");
  const RmaKey& key = peers_[peer].key;
  if (!rma_fits(key, offset, len))  // its key disagrees with its window
    fail(ErrorCode::INVALID_ARGUMENT, peer, std::string(name) + ": outside " + who(peer) + "'s registered window");
  const uint64_t n = piece_count(len, kChunkBytes);
  for (uint64_t i = 0; i < n; i++) {
    const Piece pc = piece(len, kChunkBytes, i);
    ibv_qp* qp = room(peer, name, wait, lock);
    const uint32_t k = tracker_.take({peer, op, op == RmaOp::READ ? local + pc.at : nullptr, pc.len});
    char* stage = staging_->base() + size_t{k} * kChunkBytes;
    if (op == RmaOp::WRITE) std::memcpy(stage, local + pc.at, pc.len);
    ibv_sge sge{reinterpret_cast<uintptr_t>(stage), pc.len, staging_->lkey()};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = rma_wr_id(id_, k);
    wr.opcode = op == RmaOp::WRITE ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = key.addr + offset + pc.at;
    wr.wr.rdma.rkey = key.rkey;
    // libibverbs is thread safe: the channel may post on this queue pair from the engine's
    // driver meanwhile; its send queue holds VerbsRmaHub::kDepth more for these.
    if (int rc = ibv_post_send(qp, &wr, &bad)) {
      tracker_.untake(k);
      fail(ErrorCode::PEER_FAILURE, peer, std::string(name) + ": ibv_post_send of an " + op_name(op) + " to " +
                                              who(peer) + " failed: " + std::strerror(rc));
    }
    hub_->busy[peer]++;
  }
}

bool VerbsRmaWindow::put(int peer, const void* src, uint64_t len, uint64_t offset, int signal, const RmaWait& wait) {
  Lock lock(hub_->mu);
  transfer(RmaOp::WRITE, peer, const_cast<char*>(static_cast<const char*>(src)), len, offset, wait, lock);
  if (signal < 0) return true;
  // Data first: everything issued to the peer completes (its READs too, so that a signal
  // never overtakes an earlier get of this rank), then the caller sends the signal.
  lock.unlock();
  flush(peer, wait);
  return false;
}

void VerbsRmaWindow::get(int peer, void* dst, uint64_t len, uint64_t offset, const RmaWait& wait) {
  if (!len) return;
  Lock lock(hub_->mu);
  transfer(RmaOp::READ, peer, static_cast<char*>(dst), len, offset, wait, lock);
}

void VerbsRmaWindow::on_completion(int peer, const ibv_wc& wc) {
  const uint32_t k = rma_wr_chunk(wc.wr_id);
  RmaChunk c;
  if (!tracker_.finish(k, peer, &c)) {
    tracker_.failed(peer, "a completion for no RMA of this window: corrupt work-request id");
    return;
  }
  if (wc.status != IBV_WC_SUCCESS) {
    tracker_.failed(peer, std::string(op_name(c.op)) + ": " + lib().wc_status_str(wc.status));
    return;
  }
  // Copied out before the lock is let go: no other transfer can stage into chunk k meanwhile.
  if (c.op == RmaOp::READ && c.dst) std::memcpy(c.dst, staging_->base() + size_t{k} * kChunkBytes, c.len);
}

void VerbsRmaWindow::flush(int peer, const RmaWait& wait) {
  if (peer < -1 || peer >= static_cast<int>(hub_->qps.size()))
    fail(ErrorCode::INVALID_ARGUMENT, -1, "flush: no rank " + std::to_string(peer));
  auto pending = [&] { return !closed_ && !hub_->released && tracker_.in_flight(peer) > 0; };
  {
    Lock lock(hub_->mu);
    check_open("flush");
    if (!pending()) return report(peer, "flush");
  }
  try {
    wait([&] {
      Lock l(hub_->mu);
      return !pending();
    });
  } catch (...) {
    // Timeout, Ctrl-C, a dead peer: the gets still in flight copy nowhere when they complete
    // (their buffers may be gone by then); a hung peer that wakes writes only into staging.
    Lock lock(hub_->mu);
    if (!closed_ && !hub_->released) tracker_.abandon(peer);
    throw;
  }
  Lock lock(hub_->mu);
  check_open("flush");
  report(peer, "flush");
}

bool VerbsRmaWindow::flushed(int peer) {
  if (peer < -1 || peer >= static_cast<int>(hub_->qps.size()))
    fail(ErrorCode::INVALID_ARGUMENT, -1, "flush: no rank " + std::to_string(peer));
  Lock lock(hub_->mu);
  return tracker_.in_flight(peer) == 0 && !tracker_.has_error(peer);
}

void VerbsRmaWindow::close() {
  Lock lock(hub_->mu);
  if (closed_) return;
  closed_ = true;
  if (!hub_->released) release();
  hub_->windows.erase(id_);
}

// The window's memory first: a key a peer still holds reaches nothing once it is deregistered
// (the peer's access fails with a remote access error). Staging with work in flight stays
// registered (the NIC may still read or write it) until the hub, which outlives the queue
// pairs, goes.
void VerbsRmaWindow::release() {
  if (mr_) lib().dereg_mr(mr_), mr_ = nullptr;
  if (staging_ && tracker_.in_flight(-1) > 0) hub_->orphans.push_back(std::move(staging_));
  staging_.reset();
}

void VerbsRmaHub::connected(int peer, ibv_qp* qp) {
  std::lock_guard<std::mutex> lock(mu);
  qps.at(peer) = qp;
}

void VerbsRmaHub::detach(int peer) {
  std::lock_guard<std::mutex> lock(mu);
  qps.at(peer) = nullptr;
}

void VerbsRmaHub::detached(int peer) {
  std::lock_guard<std::mutex> lock(mu);
  busy.at(peer) = 0;
  for (auto& [id, w] : windows) w->lost(peer);
}

void VerbsRmaHub::completed(int peer, const ibv_wc& wc) {
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(peer) < busy.size() && busy[peer]) busy[peer]--;
  auto it = windows.find(rma_wr_window(wc.wr_id));
  if (it != windows.end()) it->second->on_completion(peer, wc);  // else its window closed: nothing to do
}

void VerbsRmaHub::release() {
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [id, w] : windows) w->release();
  windows.clear();
  std::fill(qps.begin(), qps.end(), nullptr);
  released = true;
}

std::unique_ptr<RmaWindow> open_verbs_rma_window(const std::shared_ptr<VerbsRmaHub>& hub, const RmaMemory& mem,
                                                 int rank) {
  auto w = std::make_unique<VerbsRmaWindow>(hub, rank);
  if (!w->open(mem)) return nullptr;  // its destructor deregisters what was registered
  return w;
}

}  // namespace comm::verbs
