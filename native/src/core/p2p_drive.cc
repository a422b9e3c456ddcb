// Who drives the p2p engine (p2p.h): a blocking caller on its own thread, or the p2p thread;
// the hand-over between them, the thread's listening for one-sided traffic, and the waiting
// discipline of a driver with nothing to move.
#include <unistd.h>

#include "core/p2p.h"

namespace comm {

bool P2P::drive_until(const std::function<bool()>& done) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) fail(ErrorCode::CLOSED, -1, "the communicator is closed");
  if (broken_) throw *broken_;
  if (driving_ && thread_driving_ && !done()) {  // as finish_on_caller: the p2p thread hands over
    handoffs_++;
    wake();
    cv_.wait(lock, [&] { return !driving_ || done(); });
    handoffs_--;
  }
  if (done()) return true;
  if (driving_) return false;
  drive(lock, nullptr, &done);
  return true;
}

// A blocking caller drives until `op` is done, unless another caller drives already (then it
// waits: that driver completes the op, or fails it by its deadline).
void P2P::finish_on_caller(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Op>& op) {
  if (driving_ && thread_driving_ && !op->test()) {
    // The p2p thread drives (a window keeps it listening): it hands over to this caller
    // (no thread hop per message on the latency path).
    handoffs_++;
    wake();
    cv_.wait(lock, [&] { return !driving_ || op->test(); });
    handoffs_--;
  }
  if (!driving_ && !op->test()) {
    drive(lock, op.get());
  } else if (!op->test()) {
    lock.unlock();
    op->wait(-1);
  }
}

void P2P::wake() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
  if (c_.shm) c_.shm->interrupt();
}

void P2P::stop() {
  std::unique_lock<std::mutex> lock(mu_);
  stopping_ = true;
  wake();
  cv_.notify_all();
  thread_cv_.notify_one();
  cv_.wait(lock, [&] { return !driving_; });  // a caller's thread may be driving
  lock.unlock();
  if (thread_.joinable()) thread_.join();
}

void P2P::thread_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    const bool free = !driving_ && !handoffs_;
    if (free && pending_ > 0) {
      drive(lock, nullptr);
    } else if (free && listening()) {
      const auto quiet = last_release_ + kListenGrace;  // see kListenGrace
      if (Clock::now() >= quiet) {
        drive(lock, nullptr);
      } else {
        thread_timed_ = true;
        thread_cv_.wait_until(lock, quiet);
        thread_timed_ = false;
      }
    } else {
      thread_cv_.wait(lock);  // nothing to do, or a caller drives: its release wakes us
    }
  }
}

// Drives until `until` is done or done() (a blocking caller), or nothing is pending (the
// thread; it returns early when a caller took the role while it slept as a listener).
void P2P::drive(std::unique_lock<std::mutex>& lock, const Op* until, const std::function<bool()>* done) {
  const bool caller = until || done;
  driving_ = true;
  thread_driving_ = !caller;
  Backoff spins;
  bool moved = false;  // since this drive began
  auto more = [&] {
    if (until) return !until->test();
    if (done) return !broken_ && !(*done)();
    return (pending_ > 0 || listening()) && !handoffs_;
  };
  while (more()) {
    if (stopping_) {
      fail_all(CommError(ErrorCode::CLOSED, -1, "the communicator was closed"));
      break;
    }
    try {
      if (pass()) {
        spins = Backoff{};
        moved = true;
        continue;
      }
      if (!idle(lock, spins, caller, moved)) return;  // a caller drives now; the thread waits
    } catch (const CommError& e) {
      if (!lock.owns_lock()) lock.lock();
      if (done && e.code == ErrorCode::INTERRUPTED) {  // Ctrl-C in wait_signal: no stream broke
        release_driver();
        throw;
      }
      if (!caller && pending_ == 0 && left_cleanly(e)) continue;
      fail_all(e);
    }
  }
  release_driver();
}

bool P2P::left_cleanly(const CommError& e) {
  // Only listening (a window keeps the streams drained), a peer's stream ended: where the peer
  // said goodbye (its monitor's word, waited for as Comm::explain does) it closed cleanly and
  // nothing more comes from it. That is no failure: passed on, the other ranks took it for a
  // death (3 ranks, a window, then an all_reduce: the rank still in it failed with "rank 2 is
  // gone" in 1 of 9 runs beside other jobs).
  if (e.code != ErrorCode::PEER_FAILURE || e.peer < 0 || e.peer >= c_.size) return false;
  (void)c_.explain(e);
  if (!c_.peers[e.peer].said_goodbye.load(std::memory_order_acquire)) return false;
  peers_[e.peer].left = true;
  return true;
}

void P2P::release_driver() {
  const bool caller = !thread_driving_;
  driving_ = thread_driving_ = false;
  // Whatever is still pending goes to the p2p thread; stop() may be waiting for us.
  if ((pending_ > 0 || listening()) && !thread_.joinable()) thread_ = std::thread([this] { thread_loop(); });
  if (pending_ > 0 && listener_asleep_) wake();  // it sleeps in poll(), not on a condition
  if (caller) {
    last_release_ = Clock::now();
    if (pending_ > 0 || (listening() && !thread_timed_)) thread_cv_.notify_one();
  }
  cv_.notify_all();  // callers waiting for a hand-over, stop()
}

// Nothing moved: wait (without the lock, so others can post) until a stream is ready, a
// post wakes us, or a sleep slice passes; timeouts are checked by the next pass().
bool P2P::idle(std::unique_lock<std::mutex>& lock, Backoff& spins, bool caller, bool moved) {
  std::vector<std::pair<Channel*, bool>> probes;  // (channel, is_send) that could move
  std::vector<pollfd> fds;
  bool shm_pending = false;
  bool stateful = false;  // a channel whose ready() arms events (UCX, verbs): one thread only
  for (const PeerState& ps : peers_) {
    if (!ps.ch || (ps.left && ps.sends.empty())) continue;
    const bool sending = !ps.sends.empty();
    probes.push_back({ps.ch, false});
    if (sending) probes.push_back({ps.ch, true});
    const auto& socks = ps.ch->sockets();
    if (socks.empty() || ps.ch->polled()) shm_pending = true;
    stateful |= ps.ch->polled();
    for (int fd : socks)
      fds.push_back({fd, static_cast<short>(ps.ch->poll_events(false) | (sending ? ps.ch->poll_events(true) : 0)), 0});
  }
  if (!fds.empty()) {
    fds.push_back({wake_fd_, POLLIN, 0});
    for (const Peer& p : c_.peers)
      if (p.monitor_fd >= 0 && !p.said_goodbye) fds.push_back({p.monitor_fd, POLLIN, 0});
    if (shm_pending) fds.push_back({-1, 0, 0});  // shared memory cannot wake poll(): poll briefly
  }
  auto ready = [&] {
    for (auto [ch, is_send] : probes) {
      Transfer probe;
      probe.is_send = is_send;
      if (ch->ready(probe)) return true;
    }
    return false;
  };
  const bool listening_only = pending_ == 0 && !caller;
  bool asleep = false;
  if (listening_only && (!moved || (spins.calls > 0 && Clock::now() - spins.start > kListenYield))) {
    // Only listening for one-sided traffic, and quiet (for a while, or since it began: a
    // listener that moved nothing does not yield): sleep at once (a peer's bytes wake the poll
    // or the futex). Spinning or yielding would take the cores, and this lock, from the
    // application; yielding for a moment after a message catches the next one of a burst.
    spins.calls = std::max(spins.calls, 1 << 20);
    spins.start = Clock::time_point{};
    // Asleep, the thread lets go of the driver role: a blocking send / recv, a flush or a
    // wait_signal drives at once on its own thread instead of waking this one and waiting
    // for the hand-over (see native/TUNING.md, "One-sided and send / recv: the caller's
    // thread drives").
    // Only where ready() is a plain look (shared memory, sockets), safe beside a driver.
    if (!stateful) {
      asleep = true;
      driving_ = thread_driving_ = false;
      listener_asleep_ = true;
      cv_.notify_all();
    }
  }
  const Deadline none;  // op deadlines are enforced by pass(); this only bounds the sleep
  lock.unlock();
  auto retake = [&] {  // after the sleep: the role again, unless a caller has it now
    lock.lock();
    listener_asleep_ = false;
    if (driving_) return false;
    driving_ = thread_driving_ = true;
    return true;
  };
  try {
    c_.idle(spins, ready, &fds, &none, !listening_only && (shm_pending || fds.empty()));  // sockets alone: poll() at once
  } catch (const CommError&) {
    if (asleep && !retake()) return false;  // the driving caller meets the failure itself
    throw;
  }
  if (asleep) {
    if (!retake()) return false;
  } else {
    lock.lock();
  }
  for (int p = 0; p < c_.size; p++) {
    const PeerState& ps = peers_[p];
    if (ps.ch && ps.ch->sockets().empty()) c_.check_closed_peer(p, [&] { return stuck(ps); });
    // After a pass found nothing to move (pass() runs before every idle()).
    else if (ps.ch && ps.ch->flushed_before_goodbye()) c_.check_closed_peer(p, [&] { return busy(ps); });
  }
  return true;
}

// Work pending with this peer.
bool P2P::busy(const PeerState& ps) const {
  return !ps.recvs.empty() || ps.target || ps.stage != Stage::HEADER || !ps.sends.empty() ||
         !ps.win_gets.empty() || !ps.win_flushes.empty();
}

// Pending work with this peer that its stream cannot move now.
bool P2P::stuck(const PeerState& ps) const {
  Transfer probe;
  const bool receiving = !ps.recvs.empty() || ps.target || ps.stage != Stage::HEADER ||
                         !ps.win_gets.empty() || !ps.win_flushes.empty();
  if (receiving && !ps.ch->ready(probe)) return true;
  probe.is_send = true;
  return !ps.sends.empty() && !ps.ch->ready(probe);
}

}  // namespace comm
