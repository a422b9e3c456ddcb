// TCP channel to one peer over one or more connected sockets. Large payloads are striped
// across the sockets (several flows fill a link one flow cannot); the header always goes
// on the first socket, so both ends split every message the same way.
#pragma once

#include <vector>

#include "channels/channel.h"

namespace comm {

class TcpChannel final : public Channel {
 public:
  TcpChannel(int peer, std::vector<int> fds);  // takes ownership of fds
  ~TcpChannel() override;
  bool progress(Transfer& t) override;
  bool ready(const Transfer&) const override { return false; }  // poll() decides
  const std::vector<int>& sockets() const override { return fds_; }
  void shutdown() override;

 private:
  int stripes(size_t len) const { return len >= kStripeMinBytes ? static_cast<int>(fds_.size()) : 1; }
  bool send_part(Transfer& t, int i, size_t begin, size_t end);
  bool recv_part(Transfer& t, int i, size_t begin, size_t end);
  [[noreturn]] void lost(const char* what) const;
  std::vector<int> fds_;
};

// Sets O_NONBLOCK and TCP_NODELAY on a socket handed over by the Python bootstrap.
void prepare_socket(int fd);

}  // namespace comm
