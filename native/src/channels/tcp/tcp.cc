#include "channels/tcp/tcp.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

namespace comm {

void prepare_socket(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) fail_errno("fcntl(O_NONBLOCK)");
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

TcpChannel::TcpChannel(int peer, std::vector<int> fds) : Channel(peer), fds_(std::move(fds)) {
  if (fds_.size() > static_cast<size_t>(kMaxStripes)) fds_.resize(kMaxStripes);
  for (int fd : fds_) prepare_socket(fd);
}

TcpChannel::~TcpChannel() {
  for (int fd : fds_) close(fd);
}

void TcpChannel::shutdown() {
  for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
}

void TcpChannel::lost(const char* what) const {
  fail(ErrorCode::PEER_FAILURE, peer_,
       "connection to rank " + std::to_string(peer_) + " lost (" + what +
           "): the peer process died or closed its communicator");
}

// Stripe i of a payload of `len` bytes is [i*len/k, (i+1)*len/k).
static size_t stripe_begin(size_t len, int i, int k) {
  return static_cast<size_t>((static_cast<unsigned __int128>(len) * i) / k);
}

bool TcpChannel::progress(Transfer& t) {
  bool moved = false;
  // t.len is re-read each time: a drained receive learns its length from the header (i = 0).
  for (int i = 0; i < stripes(t.len); i++) {
    const int k = stripes(t.len);
    size_t begin = stripe_begin(t.len, i, k), end = stripe_begin(t.len, i + 1, k);
    moved |= t.is_send ? send_part(t, i, begin, end) : recv_part(t, i, begin, end);
  }
  return moved;
}

// Socket 0 carries the header in front of its stripe; one sendmsg sends both.
bool TcpChannel::send_part(Transfer& t, int i, size_t begin, size_t end) {
  iovec iov[2];
  int n_iov = 0;
  const bool hdr = i == 0 && !t.header_complete();
  if (hdr) iov[n_iov++] = {reinterpret_cast<char*>(&t.hdr) + t.hdr_done, sizeof(WireHeader) - t.hdr_done};
  size_t at = begin + t.part_done[i];
  if (at < end) iov[n_iov++] = {t.buf + at, end - at};
  if (n_iov == 0) return false;
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = n_iov;
  ssize_t n = sendmsg(fds_[i], &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
    lost(std::strerror(errno));
  }
  size_t sent = static_cast<size_t>(n);
  if (hdr) {
    size_t h = std::min(sent, sizeof(WireHeader) - t.hdr_done);
    t.hdr_done += h;
    sent -= h;
  }
  t.part_done[i] += sent;
  t.done += sent;
  return n > 0;
}

// The header is read alone and checked before a payload byte is accepted into the buffer.
bool TcpChannel::recv_part(Transfer& t, int i, size_t begin, size_t end) {
  bool moved = false;
  if (i == 0 && !t.header_complete()) {
    ssize_t n = recv(fds_[0], reinterpret_cast<char*>(&t.got) + t.hdr_done,
                     sizeof(WireHeader) - t.hdr_done, MSG_DONTWAIT);
    if (n == 0) lost("end of stream");
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      lost(std::strerror(errno));
    }
    t.hdr_done += static_cast<size_t>(n);
    if (!t.header_complete()) return true;
    accept_header(t, peer_);
    if (t.drain) return true;  // [begin, end) came from the old length
    moved = true;
  }
  if (!t.header_complete()) return moved;
  size_t at = begin + t.part_done[i];
  if (at >= end) return moved;
  static thread_local char sink[64 << 10];  // where a drained payload goes
  ssize_t n = t.drain ? recv(fds_[i], sink, std::min(end - at, sizeof sink), MSG_DONTWAIT)
                      : recv(fds_[i], t.buf + at, end - at, MSG_DONTWAIT);
  if (n == 0) lost("end of stream");
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return moved;
    lost(std::strerror(errno));
  }
  t.part_done[i] += static_cast<size_t>(n);
  t.done += static_cast<size_t>(n);
  return true;
}

}  // namespace comm
