#include "p2p.h"

#include <cstring>
#include <string>

namespace comm {

P2P::P2P(Comm& c) : c_(c), inbound_(c.size) {
  for (int p = 0; p < c.size; p++)
    if (c.peers[p].p2p) start_header(p);
}

void P2P::start_header(int peer) {
  Inbound& in = inbound_[peer];
  in = Inbound{};
  in.t.ch = c_.peers[peer].p2p.get();
  in.t.check = Transfer::Check::NONE;  // the tag decides where the body goes
}

void P2P::send(int peer, int tag, DType dtype, const void* buf, size_t bytes) {
  Transfer t;
  t.ch = c_.peers[peer].p2p.get();
  t.is_send = true;
  t.buf = const_cast<char*>(static_cast<const char*>(buf));
  t.len = bytes;
  t.hdr.kind = static_cast<uint8_t>(OpKind::SEND);
  t.hdr.dtype = static_cast<uint8_t>(dtype);
  t.hdr.tag = tag;
  t.hdr.len = bytes;
  t.hdr.count = bytes / itemsize(dtype);
  t.hdr.seq = sent_[{peer, tag}]++;
  Backoff spins;
  while (!t.complete()) {
    bool moved = t.ch->progress(t);
    for (int p = 0; p < c_.size; p++)
      if (c_.peers[p].p2p) moved |= drain(p, nullptr);
    if (moved) {
      spins = Backoff{};
      continue;
    }
    idle(spins, [&] { return t.ch->ready(t); }, peer, -1);
  }
}

void P2P::recv(int peer, int tag, DType dtype, void* buf, size_t bytes) {
  Wanted want{tag, dtype, static_cast<char*>(buf), bytes};
  auto& queue = parked_[{peer, tag}];
  if (!queue.empty()) {
    accept(peer, queue.front().hdr, want);
    std::memcpy(buf, queue.front().body.data(), bytes);
    queue.pop_front();
    return;
  }
  Backoff spins;
  while (!want.done) {
    if (drain(peer, &want)) {
      spins = Backoff{};
      // The message we want may have been parked while our body was in flight.
      if (!want.done && !queue.empty()) return recv(peer, tag, dtype, buf, bytes);
      continue;
    }
    Inbound& in = inbound_[peer];
    idle(spins, [&] { return in.t.ch->ready(in.t); }, -1, peer);
  }
}

// Checks a matched message against the receive and advances the (peer, tag) counter.
void P2P::accept(int peer, const WireHeader& h, Wanted& want) {
  const uint64_t expected_seq = received_[{peer, want.tag}]++;
  if (h.kind != static_cast<uint8_t>(OpKind::SEND) || h.dtype != static_cast<uint8_t>(want.dtype) ||
      h.len != want.bytes || h.seq != expected_seq)
    fail(ErrorCode::MISMATCH, peer,
         "recv from rank " + std::to_string(peer) + " with tag " + std::to_string(want.tag) +
             " expected " + std::to_string(want.bytes) + " bytes of dtype " +
             std::to_string(static_cast<int>(want.dtype)) + " but rank " + std::to_string(peer) +
             " sent " + std::to_string(h.len) + " bytes of dtype " + std::to_string(h.dtype));
}

bool P2P::drain(int peer, Wanted* want) {
  Inbound& in = inbound_[peer];
  bool moved = in.t.ch->progress(in.t);
  if (!in.in_body && in.t.complete()) {
    const WireHeader h = in.t.got;
    Transfer body;
    body.ch = in.t.ch;
    body.with_header = false;
    body.len = h.len;
    in.to_wanted = want && h.tag == want->tag && parked_[{peer, h.tag}].empty();
    if (in.to_wanted) {
      accept(peer, h, *want);
      body.buf = want->buf;
    } else {
      in.parked.hdr = h;
      in.parked.body.resize(h.len);
      body.buf = in.parked.body.data();
    }
    in.t = body;
    in.in_body = true;
    moved = true;
  }
  if (in.in_body) {
    moved |= in.t.ch->progress(in.t);
    if (in.t.complete()) {
      if (in.to_wanted) want->done = true;
      else parked_[{peer, in.parked.hdr.tag}].push_back(std::move(in.parked));
      start_header(peer);
    }
  }
  return moved;
}

template <class Ready>
void P2P::idle(Backoff& spins, Ready ready, int send_peer, int recv_peer) {
  std::vector<pollfd> fds;
  bool shm_pending = false;
  auto add = [&](int peer, short events) {
    const auto& socks = c_.peers[peer].p2p->sockets();
    if (socks.empty()) shm_pending = true;
    for (int fd : socks) fds.push_back({fd, events, 0});
  };
  if (send_peer >= 0) {
    add(send_peer, POLLOUT);
    for (int p = 0; p < c_.size; p++)
      if (c_.peers[p].p2p) add(p, POLLIN);
  }
  if (recv_peer >= 0) add(recv_peer, POLLIN);
  if (!fds.empty()) {
    for (const Peer& p : c_.peers)
      if (p.monitor_fd >= 0 && !p.said_goodbye) fds.push_back({p.monitor_fd, POLLIN, 0});
    if (shm_pending) fds.push_back({-1, 0, 0});
  }
  c_.idle(spins, ready, &fds);
}

}  // namespace comm
