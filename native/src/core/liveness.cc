// The watcher: reads every connected peer's monitor while no operation does. A rank that
// is connected to a few peers only (connections on demand) hears of a death first hand only
// from those; the rest learn it as hearsay ('F' + the lost rank) that each rank passes on to
// its own peers the first time it hears it (Comm::hear). A flood needs every rank to take part,
// also one that is idle or blocked in Python: hence this thread rather than the operations'
// own checks. It only reads and relays; operations fail from what it recorded (check_alive).
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "core/comm.h"

namespace comm {

void Comm::watch_start() {
  if (watcher_) return;
  watch_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (watch_fd_ < 0) fail_errno("eventfd");
  watching_.store(true);
  watcher_ = std::make_unique<std::thread>([this] { watch_loop(); });
}

void Comm::watch_stop() {
  if (!watcher_) return;
  watching_.store(false);
  watch_wake();
  watcher_->join();
  watcher_.reset();
  ::close(watch_fd_);
  watch_fd_ = -1;
}

void Comm::watch_wake() {
  const uint64_t one = 1;
  if (watch_fd_ >= 0) (void)!write(watch_fd_, &one, sizeof one);
}

int Comm::first_lost() {
  std::lock_guard<std::mutex> lock(alive_mu_);
  for (int r = 0; r < size; r++)
    if (peers[r].heard == 'D' || peers[r].heard == 'A') return r;
  return lost_;
}

void Comm::watch_loop() {
  std::vector<pollfd> fds;
  std::vector<int> who;  // the peer of fds[i]; -1 for the wake-up
  while (watching_.load() && !aborted.load()) {
    fds.assign(1, pollfd{watch_fd_, POLLIN, 0});
    who.assign(1, -1);
    {
      std::lock_guard<std::mutex> lock(alive_mu_);
      for (int r = 0; r < size; r++) {
        const Peer& p = peers[r];
        // Nothing more can come from a peer that left or whose end is known.
        if (p.monitor_fd < 0 || p.said_goodbye || p.heard == 'A' || p.heard == 'R' || p.heard == 'D') continue;
        fds.push_back({p.monitor_fd, POLLIN | POLLRDHUP, 0});
        who.push_back(r);
      }
    }
    if (poll(fds.data(), fds.size(), -1) <= 0) continue;
    if (fds[0].revents) {
      uint64_t n;
      (void)!read(watch_fd_, &n, sizeof n);
    }
    // Our own abort shut the monitors down: every one now reads as a hang-up.
    if (!watching_.load() || aborted.load()) return;
    std::lock_guard<std::mutex> lock(alive_mu_);
    for (size_t i = 1; i < fds.size(); i++) {
      if (!fds[i].revents) continue;
      Peer& p = peers[who[i]];
      int32_t lost;
      while (!p.said_goodbye && hear(p, &lost, who[i]) == 'F') {}
    }
  }
}

}  // namespace comm
