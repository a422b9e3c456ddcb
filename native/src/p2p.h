// Tagged send / recv on each peer's p2p stream. Messages with the same (peer, tag) match
// in order; a message whose tag nobody waits for yet is parked in memory, so receives may
// be posted in any tag order. A blocked send drains incoming messages meanwhile, so two
// ranks sending to each other at once cannot deadlock on full buffers.
#pragma once

#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "comm.h"

namespace comm {

class P2P {
 public:
  explicit P2P(Comm& c);
  void send(int peer, int tag, DType dtype, const void* buf, size_t bytes);
  void recv(int peer, int tag, DType dtype, void* buf, size_t bytes);

 private:
  struct Parked {
    WireHeader hdr;
    std::vector<char> body;
  };
  struct Wanted {
    int tag;
    DType dtype;
    char* buf;
    size_t bytes;
    bool done = false;
  };
  // Incoming message being read from one peer: its header first, then its body.
  struct Inbound {
    Transfer t;
    bool in_body = false;
    bool to_wanted = false;
    Parked parked;
  };
  bool drain(int peer, Wanted* want);
  void start_header(int peer);
  void accept(int peer, const WireHeader& h, Wanted& want);
  template <class Ready>
  void idle(Backoff& spins, Ready ready, int send_peer, int recv_peer);

  Comm& c_;
  std::vector<Inbound> inbound_;
  std::map<std::pair<int, int>, uint64_t> sent_, received_;
  std::map<std::pair<int, int>, std::deque<Parked>> parked_;
};

}  // namespace comm
