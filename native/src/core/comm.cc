#include "core/comm.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace comm {

WireHeader Coll::header(size_t len) const {
  WireHeader h;
  h.kind = static_cast<uint8_t>(kind);
  h.dtype = static_cast<uint8_t>(dtype);
  h.op = static_cast<uint8_t>(op);
  h.flags = static_cast<uint8_t>(wire);  // a rank calling compressed beside exact ones: MISMATCH
  h.seq = seq;
  h.count = count;
  h.root = root;
  h.len = len;
  return h;
}

static Group everyone(int rank, int size) {
  Group g;
  for (int r = 0; r < size; r++) g.ranks.push_back(r);
  g.me = rank;
  return g;
}

Comm::Comm(int rank_, int size_, Options opt_)
    : rank(rank_), size(size_), opt(std::move(opt_)), world(everyone(rank_, size_)),
      topo(std::vector<int>(size_, 0), rank_), peers(size_) {}

Comm::~Comm() { release(); }

void Comm::release() {
  watch_stop();  // it polls the monitors closed below
  for (Peer& p : peers) {
    if (p.monitor_fd >= 0) close(p.monitor_fd);
    p.coll.reset();
    p.p2p.reset();
    p.monitor_fd = -1;
    p.said_goodbye = false;
    p.heard = 0;
  }
  goodbyes_ = 0;
  shm.reset();
  net.reset();
}

void Comm::close_channels() {
  std::lock_guard<std::mutex> lock(alive_mu_);
  for (Peer& p : peers) {
    int32_t lost = -1;
    // Read past relayed failures ('F') to a goodbye, hang-up or abort, if one came.
    while (p.monitor_fd >= 0 && !p.said_goodbye && hear(p, &lost, static_cast<int>(&p - peers.data())) == 'F') {
    }
    const bool left = p.said_goodbye || p.heard == 'D' || p.heard == 'A';
    for (auto* ch : {&p.coll, &p.p2p}) {
      if (*ch && left) (*ch)->peer_left();
      ch->reset();
    }
  }
}

void Comm::forget() {
  if (net) {
    // A fabric library's state is the parent's (threads, registrations, connections that
    // closing would tear down for it): leak it in the child rather than release it.
    net->forget();
    for (Peer& p : peers) {
      (void)p.coll.release();
      (void)p.p2p.release();
    }
    (void)net.release();
  }
  // The watcher is the parent's thread: the child has only its object, never to be joined.
  (void)watcher_.release();
  if (watch_fd_ >= 0) ::close(watch_fd_);
  watch_fd_ = -1;
  release();  // close() and munmap() act on this process's copies only
}

void Comm::set_local_ranks_known() {
  // More local ranks than cores: a spinning rank steals the core of the rank it waits for.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (shm && static_cast<unsigned>(shm->local_size()) > cores) {
    spin_calls_ = 16;
    // Then yield, briefly, and sleep on the futex. A yield hands the core to the rank that
    // shares it, which is usually the one we wait for, without the futex's two system calls
    // per wake-up. It is bounded because the scheduler may instead pick another program's
    // task for a whole time slice: then the futex, which a peer's publication ends, is
    // better (see native/TUNING.md, "Waiting: spin, yield, sleep").
    yield_for_ = std::chrono::microseconds(500);
  }
}

Channel* Comm::reach(int peer) const {
  Channel* ch = peers[peer].coll.get();
  if (ch) return ch;
  if (connector) {
    connector(peer);
    connected_on_demand.fetch_add(1, std::memory_order_relaxed);
    ch = peers[peer].coll.get();
  }
  if (!ch)
    fail(ErrorCode::SYSTEM, peer,
         "internal error: rank " + std::to_string(rank) + " has no connection to rank " + std::to_string(peer) +
             " (not among the peers its algorithms plan for) and this transport cannot connect on first use");
  return ch;
}

void Comm::register_peer(int peer, int monitor_fd, std::unique_ptr<Channel> coll, std::unique_ptr<Channel> p2p) {
  {
    std::lock_guard<std::mutex> lock(alive_mu_);
    Peer& p = peers[peer];
    if (p.coll || p.monitor_fd >= 0) {
      if (monitor_fd >= 0) ::close(monitor_fd);
      fail(ErrorCode::INVALID_ARGUMENT, peer, "rank " + std::to_string(peer) + " is connected already");
    }
    p.p2p = std::move(p2p);  // before coll: a post that sees coll finds the p2p channel too
    p.coll = std::move(coll);
    p.monitor_fd.store(monitor_fd, std::memory_order_release);
  }
  watch_wake();
}

Transfer Comm::send_to(int peer, const void* buf, size_t len, const WireHeader& h) const {
  Transfer t;
  t.ch = reach(peer);
  t.is_send = true;
  t.buf = const_cast<char*>(static_cast<const char*>(buf));
  t.len = len;
  t.hdr = h;
  t.hdr.len = len;
  return t;
}

Transfer Comm::recv_from(int peer, void* buf, size_t len, const WireHeader& h) const {
  Transfer t = send_to(peer, buf, len, h);
  t.is_send = false;
  return t;
}

void Comm::sendrecv(int to, const void* sbuf, size_t slen, int from, void* rbuf, size_t rlen,
                    const WireHeader& h) {
  Transfer ts[2] = {send_to(to, sbuf, slen, h), recv_from(from, rbuf, rlen, h)};
  run(ts, 2);
}

void Comm::run(Transfer* ts, size_t n) {
  try {
    drive(ts, n);
  } catch (const CommError&) {
    for (size_t i = 0; i < n; i++)
      if (!ts[i].complete()) ts[i].ch->abandon(ts[i]);
    throw;
  }
}

void Comm::drive(Transfer* ts, size_t n) {
  Backoff spins;
  std::vector<pollfd> fds;
  for (;;) {
    bool all_done = true;
    if (progress_pass(ts, n, &all_done)) {
      spins = Backoff{};
      continue;
    }
    if (all_done) return;
    wait_on(ts, n, spins, fds);
  }
}

void Comm::run_lanes(Steps* const* lanes, int n) {
  if (n > kMaxLanes) throw std::logic_error("run_lanes: too many lanes");
  size_t at[kMaxLanes + 1] = {};  // lane i's step at [at[i], at[i+1]); unused slots are complete
  for (int i = 0; i < n; i++) at[i + 1] = at[i] + lanes[i]->width();
  std::vector<Transfer> ts(at[n], Transfer::none());
  bool finished[kMaxLanes] = {};
  Backoff spins;
  std::vector<pollfd> fds;
  try {
    for (;;) {
      bool moved = false, all_finished = true;
      for (int i = 0; i < n; i++) {
        if (finished[i]) continue;
        Transfer* mine = ts.data() + at[i];
        if (std::all_of(mine, ts.data() + at[i + 1], [](const Transfer& t) { return t.complete(); })) {
          // Slots past the k new transfers keep finished ones: complete, never progressed.
          const int k = lanes[i]->next(mine);
          moved |= k != Steps::kWait;
          if (k == 0) {
            finished[i] = true;
            continue;
          }
        }
        all_finished = false;
      }
      if (all_finished) return;
      bool all_done = true;
      moved |= progress_pass(ts.data(), ts.size(), &all_done);
      if (moved) {
        spins = Backoff{};
        continue;
      }
      // Every lane waits for another and none has a transfer: a schedule that cannot end.
      if (all_done) throw std::logic_error("run_lanes: every lane waits for another");
      wait_on(ts.data(), ts.size(), spins, fds);
    }
  } catch (const CommError&) {
    for (Transfer& t : ts)
      if (!t.complete()) t.ch->abandon(t);
    throw;
  }
}

void run_steps(Comm& c, Steps& s) {
  std::vector<Transfer> ts(s.width(), Transfer::none());
  int k;
  while ((k = s.next(ts.data())) > 0) c.run(ts.data(), k);
  if (k < 0) throw std::logic_error("run_steps: a lone algorithm waited for another lane");
}

bool Comm::progress_pass(Transfer* ts, size_t n, bool* all_done) {
  bool moved = false;
  for (size_t i = 0; i < n; i++) {
    Transfer& t = ts[i];
    if (t.complete()) continue;
    *all_done = false;
    bool behind = false;  // an earlier transfer on the same stream must finish first
    for (size_t j = 0; j < i && !behind; j++)
      behind = ts[j].ch == t.ch && ts[j].is_send == t.is_send && !ts[j].complete();
    if (!behind) moved |= t.ch->progress(t);
  }
  return moved;
}

void Comm::wait_on(Transfer* ts, size_t n, Backoff& spins, std::vector<pollfd>& fds) {
  fds.clear();
  bool shm_pending = false, kernel_pending = false, small = true;
  for (size_t i = 0; i < n; i++) {
    if (ts[i].complete()) continue;
    const auto& socks = ts[i].ch->sockets();
    if (socks.empty() || ts[i].ch->polled()) shm_pending = true;
    else kernel_pending = true;
    small &= ts[i].len <= kSocketSpinMaxBytes;
    for (int fd : socks) fds.push_back({fd, ts[i].ch->poll_events(ts[i].is_send), 0});
  }
  if (!fds.empty()) {
    for (const Peer& p : peers)
      if (p.monitor_fd >= 0 && !p.said_goodbye) fds.push_back({p.monitor_fd, POLLIN, 0});
    if (shm_pending) fds.push_back({-1, 0, 0});  // marks "poll briefly": see sleep_fds
  }
  auto ready = [&] {
    for (size_t i = 0; i < n; i++)
      if (!ts[i].complete() && ts[i].ch->ready(ts[i])) return true;
    return false;
  };
  idle(spins, ready, &fds, nullptr, !kernel_pending || (!shm_pending && small));
  for (size_t i = 0; i < n; i++)
    if (!ts[i].complete() && ts[i].ch->sockets().empty())
      check_closed_peer(ts[i].ch->peer(), [&] { return !ts[i].ch->ready(ts[i]); });
    else if (!ts[i].complete() && ts[i].ch->flushed_before_goodbye())
      check_closed_peer(ts[i].ch->peer(), [&] { return !ts[i].ch->progress(ts[i]) && !ts[i].complete(); });
}

void Comm::sleep_fds(const std::vector<pollfd>& fds, int ms) {
  // A trailing {-1} entry means shared-memory transfers are pending too: they cannot wake
  // poll(), so poll only briefly.
  const bool brief = fds.back().fd < 0;
  int rc = poll(const_cast<pollfd*>(fds.data()), fds.size() - (brief ? 1 : 0), brief ? std::min(ms, 1) : ms);
  if (rc < 0 && errno != EINTR) fail_errno("poll");
}

void Comm::publish_round(uint64_t round) {
  shm->seg(shm->me())->round.store(round, std::memory_order_release);
  shm->wake_all_peers();
}

void Comm::wait_round(uint64_t round) {
  for (int i = 0; i < shm->local_size(); i++) {
    if (i == shm->me()) continue;
    auto& their = shm->seg(i)->round;
    Backoff spins;
    auto reached = [&] { return their.load(std::memory_order_acquire) >= round; };
    while (!reached()) {
      idle(spins, reached);
      check_closed_peer(shm->global(i), [&] { return !reached(); });
    }
  }
}

char* Comm::scratch(int which, size_t bytes) {
  if (scratch_.size() <= static_cast<size_t>(which)) scratch_.resize(which + 1);
  Scratch& s = scratch_[which];
  if (s.bytes < bytes) {
    s.data.reset(new char[bytes]);  // uninitialised on purpose: it is always written first
    s.bytes = bytes;
  }
  return s.data.get();
}

// Reads at most one word from p's monitor (with alive_mu_ held) and returns what p said:
// 0 (nothing new), 'B', 'F' (then *lost is the rank p lost), or the sticky 'A', 'R', 'D'.
char Comm::hear(Peer& p, int32_t* lost, int from) {
  if (p.heard == 'A' || p.heard == 'R' || p.heard == 'D') return p.heard;
  pollfd pfd{p.monitor_fd, POLLIN | POLLRDHUP, 0};
  if (poll(&pfd, 1, 0) <= 0) return 0;
  char c = 0;
  ssize_t got = recv(p.monitor_fd, &c, 1, MSG_DONTWAIT);
  if (got < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
  if (got == 1 && c == 'B') {
    p.said_goodbye.store(true, std::memory_order_release);
    goodbyes_.fetch_add(1, std::memory_order_relaxed);
    return p.heard = 'B';
  }
  if (got == 1 && c == 'F' && recv(p.monitor_fd, lost, sizeof *lost, MSG_WAITALL) == sizeof *lost) {
    if (*lost >= 0 && *lost < size && *lost != rank) {
      if (lost_ < 0) lost_ = *lost, lost_via_ = from;
      relay_lost(*lost);
    }
    return 'F';
  }
  p.heard = (got == 1 && (c == 'A' || c == 'R')) ? c : 'D';
  // Pass it on: a death (or abort) as the loss of `from`, a revoke as a revoke.
  if (p.heard != 'R') relay_lost(from);
  else if (!relayed_revoke_ && !aborted.load()) {
    relayed_revoke_ = true;
    send_all("R", 1);
  }
  return p.heard;
}

void Comm::check_alive(const Deadline& dl) {
  if (aborted.load(std::memory_order_relaxed))
    fail(ErrorCode::ABORTED, -1, "the communicator was aborted");
  // Under the lock, a 'B'ye read by the other thread is seen before its EOF is mistaken
  // for a crash.
  std::unique_lock<std::mutex> lock(alive_mu_);
  for (int r = 0; r < size; r++) {
    Peer& p = peers[r];
    if (p.monitor_fd < 0 || p.said_goodbye) continue;
    int32_t lost = -1;
    char c;
    while ((c = hear(p, &lost, r)) == 'F') {}  // hearsay is kept in lost_
    if (c == 0 || c == 'B') continue;
    if (c == 'A') fail(ErrorCode::PEER_FAILURE, r, "rank " + std::to_string(r) + " aborted its communicator");
    if (c == 'R')
      fail(ErrorCode::REVOKED, r,
           "rank " + std::to_string(r) + " revoked the communicator; shrink() it to go on");
    fail(ErrorCode::PEER_FAILURE, r,
         "rank " + std::to_string(r) + " is gone (its process exited or was killed)");
  }
  if (lost_ >= 0)
    fail(ErrorCode::PEER_FAILURE, lost_,
         "rank " + std::to_string(lost_) + " is gone (rank " + std::to_string(lost_via_) +
             " passed on its loss, seen during an operation)");
  lock.unlock();
  if (dl.passed())
    fail(ErrorCode::TIMEOUT, -1,
         "timed out after " + std::to_string(opt.timeout_s) +
             " s (COMM_TIMEOUT): a peer is hung, slow, or did not call this operation");
}

CommError Comm::explain(const CommError& e) {
  if (e.peer < 0 || e.peer >= size || (e.code != ErrorCode::TIMEOUT && e.code != ErrorCode::PEER_FAILURE))
    return e;
  if (peers[e.peer].said_goodbye.load(std::memory_order_acquire)) return e;  // it closed: nothing to add
  // A data connection can break a little before the dead peer's monitor hangs up.
  const auto until = Clock::now() + std::chrono::milliseconds(250);
  const Deadline never;
  do {
    try {
      check_alive(never);
    } catch (const CommError& said) {
      return said;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } while (Clock::now() < until);
  return e;
}

std::vector<int> Comm::dead_peers() {
  std::vector<int> dead;
  std::lock_guard<std::mutex> lock(alive_mu_);
  // Our own abort shut the monitors down: every one now reads as a hang-up. Only what was
  // heard before it counts.
  const bool listen = !aborted.load();
  for (int r = 0; r < size; r++) {
    Peer& p = peers[r];
    if (p.monitor_fd < 0) continue;
    int32_t lost;
    while (listen && !p.said_goodbye && hear(p, &lost, r) == 'F') {}  // relayed hearsay: read past it
    if (p.heard == 'D') dead.push_back(r);
  }
  return dead;
}

void Comm::closed_peer(int peer) const {
  fail(ErrorCode::PEER_FAILURE, peer,
       "rank " + std::to_string(peer) +
           " closed its communicator (close(), or its process ended) while this rank still "
           "waits for it in this operation");
}

void Comm::abort(char why) {
  aborted.store(true);
  if (shm) shm->interrupt();
  // Peers blocked on us see the connections drop and fail instead of waiting out the timeout;
  // the 'A' (or 'R') tells them why.
  for (Peer& p : peers)
    if (p.monitor_fd >= 0) (void)!send(p.monitor_fd, &why, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
  for (Peer& p : peers) {
    if (p.coll) p.coll->shutdown();
    if (p.p2p) p.p2p->shutdown();
    if (p.monitor_fd >= 0) ::shutdown(p.monitor_fd, SHUT_RDWR);
  }
}

void Comm::relay_failure(const CommError& e) {
  if (e.code != ErrorCode::PEER_FAILURE || e.peer < 0) return;
  std::lock_guard<std::mutex> lock(alive_mu_);
  relay_lost(e.peer);
}

void Comm::relay_lost(int lost) {
  // After our own abort the monitors read as hang-ups: nothing heard then is news.
  if (lost < 0 || lost >= size || lost == rank || aborted.load()) return;
  if (relayed_lost_.empty()) relayed_lost_.assign(size, 0);
  if (relayed_lost_[lost]) return;
  relayed_lost_[lost] = 1;
  char msg[1 + sizeof(int32_t)] = {'F'};
  const int32_t who = lost;
  std::memcpy(msg + 1, &who, sizeof who);
  send_all(msg, sizeof msg);
}

void Comm::send_all(const char* msg, size_t n) {
  for (Peer& p : peers)
    if (p.monitor_fd >= 0 && !p.said_goodbye) (void)!send(p.monitor_fd, msg, n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

void Comm::say_goodbye() {
  for (Peer& p : peers)
    if (p.monitor_fd >= 0) (void)!send(p.monitor_fd, "B", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
}

}  // namespace comm
