// A window over UCX RMA (window_ucx.h): this rank's window registered with ucp_mem_map, its
// rkey packed for the peers; a peer's rkey unpacked on the endpoint of its p2p channel the
// first time this rank reaches it. put -> ucp_put_nbx, get -> ucp_get_nbx, flush ->
// ucp_ep_flush_nbx, waited for while this thread drives the engine (whose p2p channels
// progress the worker: one thread in it at a time).
//
// A signal is not a UCX atomic: once an endpoint flush has completed the data before it,
// put() says so and the window sends the signal as a message that the target's engine counts
// in (rma.h): an emulated atomic was several times slower than the message, and across hosts
// over TCP UCX found no protocol for it (see native/TUNING.md, "UCX window signals"). Nothing
// that runs here has hardware atomics; a fabric with them could add the signal itself (rma.h
// allows it), after probing the endpoint's support.
//
// Where the fabric has no RMA of its own (TCP, and shared memory for memory UCX did not
// allocate: what runs here) UCX emulates it with active messages, which the TARGET's worker
// must progress: its p2p driver does (it listens for one-sided traffic once a window exists),
// so the target's application thread does nothing here either.
#include "windows/window_ucx.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace comm {

namespace {

std::string who(int peer) { return "rank " + std::to_string(peer); }

// A key: [u64 base][u64 size][u32 n][the window's packed rkey: n bytes]. A window of 0
// bytes has none (n = 0).
struct Key {
  uint64_t base = 0, size = 0;
  std::string win;
};

std::string pack_key(const Key& k) {
  std::string out;
  auto put64 = [&](uint64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  auto put_bytes = [&](const std::string& s) {
    const uint32_t n = static_cast<uint32_t>(s.size());
    out.append(reinterpret_cast<const char*>(&n), sizeof n);
    out += s;
  };
  put64(k.base), put64(k.size);
  put_bytes(k.win);
  return out;
}

// A peer's key as it came through the store: every length checked before use.
bool unpack_key(const std::string& in, Key& k) {
  size_t at = 0;
  auto get = [&](void* to, size_t n) {
    if (in.size() - at < n) return false;
    std::memcpy(to, in.data() + at, n);
    at += n;
    return true;
  };
  auto get_bytes = [&](std::string& s) {
    uint32_t n = 0;
    if (!get(&n, sizeof n) || in.size() - at < n) return false;
    s.assign(in.data() + at, n);
    at += n;
    return true;
  };
  return get(&k.base, 8) && get(&k.size, 8) && get_bytes(k.win) && at == in.size() &&
         (k.size == 0) == k.win.empty();
}

}  // namespace

class UcxRmaWindow final : public RmaWindow {
 public:
  explicit UcxRmaWindow(std::shared_ptr<UcxRmaHub> hub) : hub_(std::move(hub)), u_(hub_->u) {}
  ~UcxRmaWindow() override { close(); }

  bool map(const RmaMemory& mem);  // false: UCX cannot register it
  const std::string& key() const override { return key_; }
  void connect(const std::vector<std::string>& keys) override;
  bool reaches(int peer) const override { return peer >= 0 && static_cast<size_t>(peer) < peers_.size() && peers_[peer].known; }
  bool put(int peer, const void* src, uint64_t len, uint64_t offset, int signal, const RmaWait& wait) override;
  void get(int peer, void* dst, uint64_t len, uint64_t offset, const RmaWait& wait) override;
  void flush(int peer, const RmaWait& wait) override;
  bool flushed(int peer) override;
  void close() override;
  void drop_endpoint(int peer);  // hub's lock held
  void release();                // hub's lock held

 private:
  struct Peer {
    bool known = false;
    Key key;
    ucp_ep_h ep = nullptr;  // the rkeys below were unpacked on it
    ucp_rkey_h win = nullptr;
    bool dirty = false;  // operations since its last flush
    // Gets still in flight: a get is done when its bytes arrived (its own completion, which
    // flush waits for besides the endpoint's flush).
    std::vector<void*> gets;
  };
  ucp_ep_h endpoint(int peer, const char* op);  // hub's lock held: the endpoint, rkeys unpacked
  void drop_rkeys(Peer& p);
  void check_open(const char* op) const;

  std::shared_ptr<UcxRmaHub> hub_;
  const Ucp& u_;
  ucp_mem_h win_memh_ = nullptr;  // null for a window of 0 bytes
  std::string key_;
  std::vector<Peer> peers_;
  bool closed_ = false;
};

bool UcxRmaWindow::map(const RmaMemory& mem) {
  Key k{reinterpret_cast<uint64_t>(mem.base), mem.size, {}};
  std::lock_guard<std::mutex> lock(hub_->mu);
  if (hub_->released) return false;
  if (mem.size) {  // a failure after the map leaves it to close() (the destructor) to unmap
    ucp_mem_map_params_t p{};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = mem.base;
    p.length = mem.size;
    void* buf = nullptr;
    size_t n = 0;
    if (u_.ucp_mem_map(hub_->ctx, &p, &win_memh_) != UCS_OK) return false;
    if (u_.ucp_rkey_pack(hub_->ctx, win_memh_, &buf, &n) != UCS_OK) return false;
    k.win.assign(static_cast<const char*>(buf), n);
    u_.ucp_rkey_buffer_release(buf);
  }
  key_ = pack_key(k);
  hub_->windows.insert(this);
  return true;
}

void UcxRmaWindow::connect(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(hub_->mu);
  peers_.assign(keys.size(), Peer{});
  for (size_t r = 0; r < keys.size(); r++) {
    if (keys[r].empty()) continue;  // that rank has no RMA window: messages to it
    if (!unpack_key(keys[r], peers_[r].key))
      fail(ErrorCode::INVALID_ARGUMENT, static_cast<int>(r), "window: a malformed UCX key from " + who(static_cast<int>(r)));
    peers_[r].known = true;
  }
}

void UcxRmaWindow::check_open(const char* op) const {
  if (closed_) fail(ErrorCode::CLOSED, -1, std::string(op) + ": the window is closed");
  if (hub_->released) fail(ErrorCode::CLOSED, -1, std::string(op) + ": the communicator is closed");
}

ucp_ep_h UcxRmaWindow::endpoint(int peer, const char* op) {
  check_open(op);
  Peer& p = peers_[peer];
  ucp_ep_h ep = static_cast<size_t>(peer) < hub_->eps.size() ? hub_->eps[peer] : nullptr;
  if (!ep) fail(ErrorCode::PEER_FAILURE, peer, std::string(op) + ": no UCX endpoint to " + who(peer) + " (closed)");
  if (p.ep == ep) return ep;
  drop_rkeys(p);  // unpacked on an endpoint that is gone
  if (!p.key.win.empty()) {  // a window of 0 bytes has no key: nothing reaches it
    const ucs_status_t st = u_.ucp_ep_rkey_unpack(ep, p.key.win.data(), &p.win);
    if (st != UCS_OK) fail_status(u_, st, peer, "rkey unpack");
  }
  p.ep = ep;
  return ep;
}

void UcxRmaWindow::drop_rkeys(Peer& p) {
  for (void* g : p.gets) u_.ucp_request_free(g);  // UCX completes them itself
  p.gets.clear();
  if (p.win) u_.ucp_rkey_destroy(p.win), p.win = nullptr;
  p.ep = nullptr;
}

// A request that completes later is freed now: its completion is what flush waits for.
static void settle(const Ucp& u, ucs_status_ptr_t r, int peer, const char* op) {
  if (UCS_PTR_IS_ERR(r)) fail_status(u, UCS_PTR_STATUS(r), peer, op);
  if (r) u.ucp_request_free(r);
}

bool UcxRmaWindow::put(int peer, const void* src, uint64_t len, uint64_t offset, int signal,
                       const RmaWait& wait) {
  std::unique_lock<std::mutex> lock(hub_->mu);
  ucp_ep_h ep = endpoint(peer, "put");
  Peer& p = peers_[peer];
  if (offset > p.key.size || len > p.key.size - offset)  // its key disagrees with its window
    fail(ErrorCode::INVALID_ARGUMENT, peer, "put: outside " + who(peer) + "'s registered window");
  ucp_request_param_t prm{};
  if (len) settle(u_, u_.ucp_put_nbx(ep, src, len, p.key.base + offset, p.win, &prm), peer, "put");
  p.dirty = p.dirty || len;
  u_.ucp_worker_progress(hub_->worker);  // sends what UCX queued instead of waiting for a flush
  if (signal < 0) return true;
  // Data first: everything issued to the peer so far completes (an endpoint flush), then the
  // caller sends the signal. ucp_worker_fence would not wait here, but its strong mode (UCX's
  // choice here) held each signal back for milliseconds, and its weak mode orders nothing
  // across lanes (see native/TUNING.md, "UCX window signals").
  lock.unlock();
  flush(peer, wait);
  return false;
}

void UcxRmaWindow::get(int peer, void* dst, uint64_t len, uint64_t offset, const RmaWait&) {
  if (!len) return;
  std::lock_guard<std::mutex> lock(hub_->mu);
  ucp_ep_h ep = endpoint(peer, "get");
  Peer& p = peers_[peer];
  if (offset > p.key.size || len > p.key.size - offset)
    fail(ErrorCode::INVALID_ARGUMENT, peer, "get: outside " + who(peer) + "'s registered window");
  ucp_request_param_t prm{};
  ucs_status_ptr_t r = u_.ucp_get_nbx(ep, dst, len, p.key.base + offset, p.win, &prm);
  if (UCS_PTR_IS_ERR(r)) fail_status(u_, UCS_PTR_STATUS(r), peer, "get");
  if (r) p.gets.push_back(r);
  p.dirty = true;
  u_.ucp_worker_progress(hub_->worker);
}

void UcxRmaWindow::flush(int peer, const RmaWait& wait) {
  std::vector<std::pair<int, void*>> pending;  // (peer, its flush request)
  // A failed wait frees what is pending (UCX completes a freed request itself). UCX cannot
  // cancel a get: after a timeout, a hung peer that wakes could still answer into its buffer.
  auto drop = [&] {
    for (auto& [_, q] : pending)
      if (q) u_.ucp_request_free(q);
    pending.clear();
  };
  {
    std::lock_guard<std::mutex> lock(hub_->mu);
    const int n = static_cast<int>(peers_.size());  // 0: connected without keys (no RMA)
    for (int r = peer < 0 ? 0 : peer; r < (peer < 0 ? n : std::min(peer + 1, n)); r++) {
      Peer& p = peers_[r];
      if (!p.dirty) continue;
      ucp_request_param_t prm{};
      ucs_status_ptr_t req = u_.ucp_ep_flush_nbx(endpoint(r, "flush"), &prm);
      p.dirty = false;
      if (UCS_PTR_IS_ERR(req)) {
        drop();
        fail_status(u_, UCS_PTR_STATUS(req), r, "flush");
      }
      if (req) pending.push_back({r, req});
      for (void* g : p.gets) pending.push_back({r, g});
      p.gets.clear();
    }
  }
  if (pending.empty()) return;
  // The engine's driver progresses the worker meanwhile (one thread in it at a time).
  int failed = -1;
  ucs_status_t why = UCS_OK;
  auto done = [&] {
    std::lock_guard<std::mutex> lock(hub_->mu);
    if (hub_->released) return true;
    for (auto& [r, q] : pending) {
      if (!q) continue;
      const ucs_status_t st = u_.ucp_request_check_status(q);
      if (st == UCS_INPROGRESS) return false;
      u_.ucp_request_free(q);
      q = nullptr;
      if (st != UCS_OK && failed < 0) failed = r, why = st;
    }
    return true;
  };
  try {
    wait(done);
  } catch (...) {
    std::lock_guard<std::mutex> lock(hub_->mu);
    if (!hub_->released) drop();
    throw;
  }
  if (hub_->released) fail(ErrorCode::CLOSED, -1, "flush: the communicator is closed");
  if (failed >= 0) fail_status(u_, why, failed, "flush");
}

bool UcxRmaWindow::flushed(int peer) {
  std::lock_guard<std::mutex> lock(hub_->mu);
  for (size_t r = 0; r < peers_.size(); r++)
    if ((peer < 0 || r == static_cast<size_t>(peer)) && peers_[r].dirty) return false;
  return true;
}

void UcxRmaWindow::close() {
  std::lock_guard<std::mutex> lock(hub_->mu);
  if (closed_) return;
  closed_ = true;
  if (!hub_->released) release();
  hub_->windows.erase(this);
}

void UcxRmaWindow::drop_endpoint(int peer) {
  if (static_cast<size_t>(peer) < peers_.size()) drop_rkeys(peers_[peer]);
}

// The rkeys first (they name the endpoints), then this rank's registrations: a key a peer
// still holds then reaches nothing (on a fabric with RMA of its own, its access fails).
void UcxRmaWindow::release() {
  for (Peer& p : peers_) drop_rkeys(p);
  if (win_memh_) u_.ucp_mem_unmap(hub_->ctx, win_memh_), win_memh_ = nullptr;
}

void UcxRmaHub::endpoint(int peer, ucp_ep_h ep) {
  std::lock_guard<std::mutex> lock(mu);
  if (eps.size() <= static_cast<size_t>(peer)) eps.resize(peer + 1, nullptr);
  eps[peer] = ep;
}

void UcxRmaHub::endpoint_closing(int peer) {
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(peer) < eps.size()) eps[peer] = nullptr;
  for (UcxRmaWindow* w : windows) w->drop_endpoint(peer);
}

void UcxRmaHub::release() {
  std::lock_guard<std::mutex> lock(mu);
  for (UcxRmaWindow* w : windows) w->release();
  windows.clear();
  eps.clear();
  released = true;
}

std::unique_ptr<RmaWindow> open_ucx_rma_window(const std::shared_ptr<UcxRmaHub>& hub, const RmaMemory& mem) {
  auto w = std::make_unique<UcxRmaWindow>(hub);
  if (!w->map(mem)) return nullptr;  // its destructor unmaps what was mapped
  return w;
}

}  // namespace comm
