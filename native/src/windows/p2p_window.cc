// The one-sided half of P2P (p2p.h, window.h): the origin's puts, gets and flushes as
// messages on a peer's p2p stream, and the target's handling of them in its driver.
#include <string>

#include "core/p2p.h"
#include "windows/window.h"

namespace comm {

void P2P::check_broken() {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_) throw *broken_;
}

void P2P::add_window(uint32_t id, WindowMemory* w) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) fail(ErrorCode::CLOSED, -1, "the communicator is closed");
    if (broken_) throw *broken_;
    windows_[id] = w;
    had_window_ = true;
    if (!thread_.joinable()) thread_ = std::thread([this] { thread_loop(); });
  }
  thread_cv_.notify_one();
  wake();
}

void P2P::remove_window(uint32_t id) {
  std::lock_guard<std::mutex> lock(mu_);  // the driver holds it while it moves bytes
  auto it = windows_.find(id);
  if (it == windows_.end()) return;
  for (PeerState& ps : peers_) {
    // A body still arriving for it (only a peer that broke the collective close sends one):
    // the rest of it is read into scratch memory, never into the window.
    if (ps.win_body && ps.win_put == it->second && !ps.in.complete()) {
      ps.discard.resize(ps.in.len);
      ps.in.buf = ps.discard.data();
      ps.win_put = nullptr;
    }
  }
  windows_.erase(it);
}

std::shared_ptr<Op> P2P::post_window(int peer, uint8_t kind, uint32_t id, uint64_t offset, char* buf,
                                     uint64_t len, int32_t signal, bool waits) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) fail(ErrorCode::CLOSED, -1, "the communicator is closed");
  if (broken_) throw *broken_;
  if (c_.aborted.load()) fail(ErrorCode::ABORTED, -1, "the communicator was aborted");
  PeerState& ps = peers_[peer];
  if (!ps.ch && c_.peers[peer].p2p) {
    ps.ch = c_.peers[peer].p2p.get();
    start_header(peer);
  }
  if (!ps.ch) fail(ErrorCode::SYSTEM, peer, "internal error: no connection to rank " + std::to_string(peer));
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(c_.opt.timeout_s));
  auto make = [&](uintptr_t send, uint64_t send_bytes, uintptr_t recv, uint64_t recv_bytes) {
    Pending p;
    p.op = std::make_shared<Op>(OpArgs{OpKind::SEND, DType::U8, ReduceOp::SUM, 1.0, send, send_bytes, recv,
                                       recv_bytes, 0, 0, peer, -1, {}, {}});
    p.deadline = deadline;
    pending_++;
    return p;
  };
  // The message: a put carries its bytes; a get and a flush only a header.
  Pending msg = make(kind == kWinPut ? reinterpret_cast<uintptr_t>(buf) : 0, kind == kWinPut ? len : 0, 0, 0);
  Transfer& t = msg.t;
  t.is_send = true;
  t.ch = ps.ch;
  t.buf = kind == kWinPut ? buf : nullptr;
  t.len = kind == kWinPut ? len : 0;
  t.hdr.kind = kind;
  t.hdr.root = static_cast<int32_t>(id);
  t.hdr.seq = offset;
  t.hdr.tag = signal;
  t.hdr.len = t.len;
  t.hdr.count = kind == kWinGet ? len : 0;
  std::shared_ptr<Op> op = msg.op;
  if (kind == kWinGet) {
    ps.win_gets.push_back(make(0, 0, reinterpret_cast<uintptr_t>(buf), len));
    op = ps.win_gets.back().op;
  } else if (kind == kWinFlush) {
    ps.win_flushes.push_back(make(0, 0, 0, 0));
    op = ps.win_flushes.back().op;
  }
  ps.sends.push_back(std::move(msg));
  if (!driving_) {
    // Nobody drives (the listener sleeps): send on this thread now, as a blocking send would,
    // instead of waking the p2p thread for it, whose hand-over costs several times the send
    // (see native/TUNING.md, "One-sided and send / recv: the caller's thread drives").
    driving_ = true;
    try {
      pass();
    } catch (const CommError& e) {
      fail_all(e);
    }
    driving_ = false;
  }
  if (!thread_.joinable()) thread_ = std::thread([this] { thread_loop(); });
  if (driving_) {
    wake();  // a sleeping driver must see the new op
  } else if (pending_ > 0 && !waits) {  // the rest is the p2p thread's
    if (listener_asleep_) wake();
    else thread_cv_.notify_one();
  }
  return op;
}

// A reply of the target (get data, a flush's answer), sent from the driver in stream order.
void P2P::queue_reply(int peer, const WireHeader& h, char* buf, uint64_t len) {
  PeerState& ps = peers_[peer];
  Pending p;
  p.op = std::make_shared<Op>(OpArgs{OpKind::SEND, DType::U8, ReduceOp::SUM, 1.0,
                                     reinterpret_cast<uintptr_t>(buf), len, 0, 0, 0, 0, peer, -1, {}, {}});
  p.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(c_.opt.timeout_s));
  p.t.is_send = true;
  p.t.ch = ps.ch;
  p.t.buf = buf;
  p.t.len = len;
  p.t.hdr = h;
  p.t.hdr.len = len;
  pending_++;
  ps.sends.push_back(std::move(p));
}

// A one-sided header from `peer` (in ps.hdr). Returns true when it is handled whole; false
// when a body follows, for which ps.in is set up (into the window, a get's destination, or
// scratch memory for a refused put).
bool P2P::window_message(int peer) {
  PeerState& ps = peers_[peer];
  const WireHeader& h = ps.hdr;
  const std::string from = "rank " + std::to_string(peer);
  auto body_into = [&](char* buf) {
    Transfer body;
    body.ch = ps.ch;
    body.with_header = false;
    body.len = h.len;
    body.buf = buf;
    ps.in = body;
  };
  auto window = [&](uint64_t len, uint8_t* why) -> WindowMemory* {
    // Everything the peer says is checked here: it may be buggy, or hostile.
    auto it = windows_.find(static_cast<uint32_t>(h.root));
    if (it == windows_.end()) {
      *why = kWinUnknown;
      return nullptr;
    }
    WindowMemory* w = it->second;
    if (h.seq > w->size || len > w->size - h.seq ||
        (h.kind == kWinPut && (h.tag < -1 || h.tag >= static_cast<int32_t>(w->signals)))) {
      *why = kWinOutside;
      return nullptr;
    }
    return w;
  };
  switch (h.kind) {
    case kWinPut: {
      uint8_t why = 0;
      ps.win_put = window(h.len, &why);
      ps.refused |= why;
      if (h.len == 0) {
        if (ps.win_put && h.tag >= 0) add_signal(ps.win_put->seg, static_cast<uint32_t>(h.tag));
        ps.win_put = nullptr;
        return true;
      }
      if (!ps.win_put) {
        if (h.len > kMaxParkedBytes)  // not worth reading: the peer is broken
          fail(ErrorCode::MISMATCH, peer, from + " put " + std::to_string(h.len) + " bytes outside any window of this rank");
        ps.discard.resize(h.len);
      }
      body_into(ps.win_put ? ps.win_put->base + h.seq : ps.discard.data());
      ps.win_body = true;
      return false;
    }
    case kWinGet: {
      uint8_t why = 0;
      WindowMemory* w = window(h.count, &why);
      WireHeader reply = h;
      reply.kind = kWinGetReply;
      reply.flags = why;
      queue_reply(peer, reply, w ? w->base + h.seq : nullptr, w ? h.count : 0);
      return true;
    }
    case kWinFlush: {
      WireHeader reply = h;
      reply.kind = kWinFlushAck;
      reply.flags = ps.refused;
      ps.refused = 0;
      queue_reply(peer, reply, nullptr, 0);
      return true;
    }
    case kWinGetReply: {
      if (ps.win_gets.empty()) fail(ErrorCode::MISMATCH, peer, from + " answered a get this rank never sent");
      const uint64_t want = ps.win_gets.front().op->args.recv_bytes;
      if (!h.flags && h.len != want)  // (fail_all ends the get, still queued, with the rest)
        fail(ErrorCode::MISMATCH, peer, from + " answered a get of " + std::to_string(want) + " bytes with " + std::to_string(h.len));
      Pending g = std::move(ps.win_gets.front());
      ps.win_gets.pop_front();
      if (h.flags) {
        ps.gets_refused |= h.flags;  // the next flush fails with it too
        finish(g, CommError(ErrorCode::INVALID_ARGUMENT, peer,
                            from + " refused a get of " + std::to_string(want) + " bytes at offset " +
                                std::to_string(h.seq) + ": " +
                                (h.flags & kWinUnknown ? "no such window there (closed?)" : "outside its window")));
        return true;
      }
      if (h.len == 0) {
        finish(g);
        return true;
      }
      body_into(reinterpret_cast<char*>(g.op->args.recv));
      ps.target = std::move(g);
      return false;
    }
    case kWinFlushAck: {
      if (ps.win_flushes.empty()) fail(ErrorCode::MISMATCH, peer, from + " answered a flush this rank never sent");
      Pending f = std::move(ps.win_flushes.front());
      ps.win_flushes.pop_front();
      const uint8_t why = h.flags | ps.gets_refused;
      ps.gets_refused = 0;
      if (why)
        finish(f, CommError(ErrorCode::INVALID_ARGUMENT, peer,
                            from + " refused puts or gets of this rank since the last flush: " +
                                (why & kWinUnknown ? "no such window there (closed?)" : "outside its window") +
                                "; nothing of them was written or read"));
      else
        finish(f);
      return true;
    }
  }
  fail(ErrorCode::MISMATCH, peer, "corrupt one-sided header from " + from);
}

void P2P::window_landed(int peer) {
  PeerState& ps = peers_[peer];
  if (ps.win_put && ps.hdr.tag >= 0) add_signal(ps.win_put->seg, static_cast<uint32_t>(ps.hdr.tag));
  ps.win_put = nullptr;
  ps.win_body = false;
  if (ps.discard.size() > (1u << 20)) ps.discard = {};
}

}  // namespace comm
