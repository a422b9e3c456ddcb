#include "core/p2p.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstring>
#include <string>

namespace comm {

namespace {
std::string describe(const OpArgs& a) {
  if (a.tag < 0) return "one-sided operation with rank " + std::to_string(a.peer);  // post_window
  const std::string who = a.peer < 0 ? "any rank" : "rank " + std::to_string(a.peer);
  return std::string(a.kind == OpKind::SEND ? "isend to " : "irecv from ") + who + " with tag " +
         std::to_string(a.tag);
}
}  // namespace

P2P::P2P(Comm& c) : c_(c), peers_(c.size) {
  for (int p = 0; p < c.size; p++) {
    peers_[p].ch = c.peers[p].p2p.get();
    if (peers_[p].ch) start_header(p);
  }
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) fail_errno("eventfd");
}

void P2P::add_peer(int peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_[peer].ch) return;
    peers_[peer].ch = c_.peers[peer].p2p.get();
    if (peers_[peer].ch) start_header(peer);
  }
  wake();  // a driver asleep in poll() adds the new stream's socket to its set
}

P2P::~P2P() {
  stop();
  close(wake_fd_);
}

void P2P::start_header(int peer) {
  PeerState& ps = peers_[peer];
  ps.in = Transfer{};
  ps.in.ch = ps.ch;
  ps.in.check = Transfer::Check::NONE;  // the tag decides where the body goes
  ps.stage = Stage::HEADER;
}

std::shared_ptr<Op> P2P::post(OpArgs a, bool blocking) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) fail(ErrorCode::CLOSED, -1, "the communicator is closed");
  if (broken_) throw *broken_;
  if (c_.aborted.load()) fail(ErrorCode::ABORTED, -1, "the communicator was aborted");
  const int peer = a.peer, tag = a.tag;
  const bool any_source = peer == -1;  // a receive from any rank (validate() allows no other -1)
  if (!any_source && !peers_[peer].ch && c_.peers[peer].p2p) {  // registered, add_peer() not yet here
    peers_[peer].ch = c_.peers[peer].p2p.get();
    start_header(peer);
  }
  if (!any_source && !peers_[peer].ch)
    fail(ErrorCode::SYSTEM, peer, "internal error: no connection to rank " + std::to_string(peer) + " for " + describe(a));
  Pending p;
  p.op = std::make_shared<Op>(std::move(a));
  p.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(c_.opt.timeout_s));
  const OpArgs& args = p.op->args;
  const size_t bytes = args.count * itemsize(args.dtype);
  auto op = p.op;
  pending_++;
  if (args.kind == OpKind::SEND) {
    Transfer& t = p.t;
    t.is_send = true;
    t.buf = reinterpret_cast<char*>(args.send);
    t.len = bytes;
    t.hdr.kind = static_cast<uint8_t>(OpKind::SEND);
    t.hdr.dtype = static_cast<uint8_t>(args.dtype);
    t.hdr.tag = tag;
    t.hdr.len = bytes;
    t.hdr.count = args.count;
    PeerState& ps = peers_[peer];
    t.ch = ps.ch;
    t.hdr.seq = ps.sent[tag]++;
    ps.sends.push_back(std::move(p));
  } else {
    p.order = next_order_++;
    try {  // the message may be here already
      if (any_source) {
        any_recvs_[tag].push_back(std::move(p));
        match_parked_any(tag);
      } else {
        peers_[peer].recvs[tag].push_back(std::move(p));
        match_parked(peer, tag);
      }
    } catch (const CommError& e) {
      fail_all(e);
    }
  }
  if (!blocking) {
    if (!thread_.joinable()) thread_ = std::thread([this] { thread_loop(); });
    if (driving_ || listener_asleep_) wake();  // a sleeping driver (or listener) must see the new op
    else thread_cv_.notify_one();
    return op;
  }
  finish_on_caller(lock, op);
  op->rethrow();
  return nullptr;
}

void P2P::wait(const std::shared_ptr<Op>& op) {
  std::unique_lock<std::mutex> lock(mu_);
  finish_on_caller(lock, op);
  op->rethrow();
}

bool P2P::pass() {
  uint64_t drained;
  (void)!read(wake_fd_, &drained, sizeof drained);
  if (c_.aborted.load()) fail(ErrorCode::ABORTED, -1, "the communicator was aborted");
  const auto now = Clock::now();
  const Pending* late = nullptr;
  auto check = [&](const Pending& p) {
    if (!late && p.deadline <= now) late = &p;
  };
  auto check_queues = [&](const RecvQueues& queues) {
    for (const auto& [tag, q] : queues)
      for (const Pending& p : q) check(p);
  };
  for (PeerState& ps : peers_) {
    for (const Pending& p : ps.sends) check(p);
    check_queues(ps.recvs);
    if (ps.target) check(*ps.target);
    for (const Pending& p : ps.win_gets) check(p);
    for (const Pending& p : ps.win_flushes) check(p);
  }
  check_queues(any_recvs_);
  if (late)
    fail(ErrorCode::TIMEOUT, -1,
         describe(late->op->args) + " not completed after " + std::to_string(c_.opt.timeout_s) +
             " s (COMM_TIMEOUT): the peer did not post the matching operation, or is hung");
  bool moved = false;
  for (int p = 0; p < c_.size; p++) {
    if (!peers_[p].ch) continue;
    moved |= progress_sends(p);
    if (!peers_[p].left) moved |= progress_inbound(p);
  }
  return moved;
}

bool P2P::progress_sends(int peer) {
  PeerState& ps = peers_[peer];
  bool moved = false;
  while (!ps.sends.empty()) {
    Pending& s = ps.sends.front();
    moved |= ps.ch->progress(s.t);
    if (!s.t.complete()) break;
    finish(s);
    ps.sends.pop_front();
    moved = true;
  }
  return moved;
}

bool P2P::progress_inbound(int peer) {
  PeerState& ps = peers_[peer];
  bool moved = false;
  for (;;) {
    if (ps.stage == Stage::HEADER) {
      moved |= ps.ch->progress(ps.in);
      if (!ps.in.header_complete()) return moved;
      const WireHeader& h = ps.in.got;
      if (is_window_kind(h.kind)) {
        if (h.len > (uint64_t{1} << 56)) fail(ErrorCode::MISMATCH, peer, "corrupt one-sided header from rank " + std::to_string(peer));
        ps.hdr = h;
        moved = true;
        if (window_message(peer)) {
          start_header(peer);
          continue;
        }
        ps.stage = Stage::BODY;  // window_message() set up ps.in for the body
      } else {
        // Checked before any allocation or byte of payload: a corrupt length must not
        // become a huge buffer or a write past a user's array.
        if (h.kind != static_cast<uint8_t>(OpKind::SEND) || h.dtype >= static_cast<uint8_t>(DType::COUNT) ||
            h.tag < 0 || h.len > (uint64_t{1} << 56) ||
            h.len != h.count * itemsize(static_cast<DType>(h.dtype)))
          fail(ErrorCode::MISMATCH, peer, "corrupt send/recv header from rank " + std::to_string(peer));
        ps.hdr = h;
        ps.stage = Stage::UNDECIDED;
      }
    }
    if (ps.stage == Stage::UNDECIDED) {
      const WireHeader& h = ps.hdr;
      Transfer body;
      body.ch = ps.ch;
      body.with_header = false;
      body.len = h.len;
      if (std::deque<Pending>* q = oldest_receive(peer, h.tag)) {
        // Oldest receive that can take it (nothing of this (peer, tag) is parked: it would
        // have been matched when that receive was posted).
        ps.target = std::move(q->front());
        q->pop_front();
        accept(peer, h, *ps.target);
        body.buf = reinterpret_cast<char*>(ps.target->op->args.recv);
      } else if (parked_bytes_ + h.len <= kMaxParkedBytes) {
        ps.park.hdr = h;
        ps.park.body.resize(h.len);
        parked_bytes_ += h.len;
        body.buf = ps.park.body.data();
      } else {
        return moved;  // flow control: wait for a receive of this tag (or the timeout)
      }
      ps.in = body;
      ps.stage = Stage::BODY;
      moved = true;
    }
    if (!ps.in.complete()) moved |= ps.ch->progress(ps.in);
    if (!ps.in.complete()) return moved;
    if (ps.win_body) {
      window_landed(peer);
    } else if (ps.target) {
      finish(*ps.target);
      ps.target.reset();
    } else {
      const int tag = ps.park.hdr.tag;
      ps.park.arrival = next_arrival_++;
      ps.parked[tag].push_back(std::move(ps.park));
      ps.park = Parked{};
      match_parked(peer, tag);  // a receive may have been posted while the body arrived
    }
    start_header(peer);
    moved = true;
  }
}

// Of the receives from `peer` and from any rank with this tag, the queue whose front was
// posted first; null when neither has one. Empty queues it passes are erased.
std::deque<P2P::Pending>* P2P::oldest_receive(int peer, int tag) {
  auto front = [tag](RecvQueues& queues) -> std::deque<Pending>* {
    auto it = queues.find(tag);
    if (it == queues.end()) return nullptr;
    if (it->second.empty()) {
      queues.erase(it);
      return nullptr;
    }
    return &it->second;
  };
  std::deque<Pending>* mine = front(peers_[peer].recvs);
  std::deque<Pending>* any = front(any_recvs_);
  if (mine && any) return mine->front().order < any->front().order ? mine : any;
  return mine ? mine : any;
}

// Hands parked messages of (peer, tag) to posted receives, oldest to oldest.
void P2P::match_parked(int peer, int tag) {
  PeerState& ps = peers_[peer];
  auto pit = ps.parked.find(tag);
  if (pit == ps.parked.end()) return;
  while (!pit->second.empty()) {
    std::deque<Pending>* q = oldest_receive(peer, tag);
    if (!q) break;
    deliver(peer, tag, *q);
  }
  if (pit->second.empty()) ps.parked.erase(pit);
}

// Hands parked messages of `tag` from any peer to receives from any rank, in arrival order.
void P2P::match_parked_any(int tag) {
  for (;;) {
    auto rit = any_recvs_.find(tag);
    if (rit == any_recvs_.end() || rit->second.empty()) return;
    int first = -1;
    for (int p = 0; p < c_.size; p++) {
      auto pit = peers_[p].parked.find(tag);
      if (pit == peers_[p].parked.end() || pit->second.empty()) continue;
      if (first < 0 || pit->second.front().arrival < peers_[first].parked[tag].front().arrival) first = p;
    }
    if (first < 0) return;
    deliver(first, tag, rit->second);
    auto& parked = peers_[first].parked;
    if (parked[tag].empty()) parked.erase(tag);
    if (rit->second.empty()) any_recvs_.erase(rit);
  }
}

// The oldest parked message of (peer, tag) completes the front receive of `receives`.
void P2P::deliver(int peer, int tag, std::deque<Pending>& receives) {
  std::deque<Parked>& parked = peers_[peer].parked[tag];
  Parked& m = parked.front();
  Pending r = std::move(receives.front());
  receives.pop_front();
  accept(peer, m.hdr, r);
  std::memcpy(reinterpret_cast<void*>(r.op->args.recv), m.body.data(), m.body.size());
  parked_bytes_ -= m.body.size();
  parked.pop_front();
  finish(r);
}

// Checks a matched message against its receive and advances the (peer, tag) counter.
void P2P::accept(int peer, const WireHeader& h, const Pending& want) {
  const OpArgs& a = want.op->args;
  want.op->source = peer;
  const uint64_t bytes = a.count * itemsize(a.dtype);
  const uint64_t expected_seq = peers_[peer].received[a.tag]++;
  if (h.dtype != static_cast<uint8_t>(a.dtype) || h.len != bytes || h.seq != expected_seq)
    fail(ErrorCode::MISMATCH, peer,
         describe(a) + " expected message " + std::to_string(expected_seq) + " of " +
             std::to_string(bytes) + " bytes of dtype " + std::to_string(static_cast<int>(a.dtype)) +
             " but rank " + std::to_string(peer) + " sent message " + std::to_string(h.seq) +
             " of " + std::to_string(h.len) + " bytes of dtype " + std::to_string(h.dtype));
}

void P2P::finish(Pending& p, std::optional<CommError> error) {
  p.op->finish(std::move(error));
  pending_--;
}

void P2P::fail_all(const CommError& e) {
  c_.relay_failure(e);
  if (!broken_) broken_ = CommError(e.code, e.peer, "an earlier send/recv or one-sided operation failed: " + e.msg);
  for (PeerState& ps : peers_) {
    if (ps.ch) {  // nothing in flight may still point at a buffer the user gets back now
      if (!ps.in.complete()) ps.ch->abandon(ps.in);
      if (!ps.sends.empty() && !ps.sends.front().t.complete()) ps.ch->abandon(ps.sends.front().t);
    }
    for (Pending& p : ps.sends) finish(p, e);
    for (auto& [tag, q] : ps.recvs)
      for (Pending& p : q) finish(p, e);
    if (ps.target) finish(*ps.target, e);
    for (Pending& p : ps.win_gets) finish(p, e);
    for (Pending& p : ps.win_flushes) finish(p, e);
    ps.win_gets.clear();
    ps.win_flushes.clear();
    ps.win_put = nullptr;
    ps.win_body = false;
    ps.sends.clear();
    ps.recvs.clear();
    ps.parked.clear();
    ps.target.reset();
    ps.park = Parked{};
  }
  for (auto& [tag, q] : any_recvs_)
    for (Pending& p : q) finish(p, e);
  any_recvs_.clear();
  parked_bytes_ = 0;
}

}  // namespace comm
