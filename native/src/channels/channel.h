// A channel moves framed messages (header + payload) to or from one peer. It knows no
// collective: algorithms describe what to move as Transfers and Comm::run drives them.
#pragma once

#include <poll.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/common.h"

namespace comm {

constexpr uint32_t kWireMagic = 0x434f4d31;  // "COM1"

// Sent before every payload, and written into every shared-memory slot: the receiver
// checks it against the operation it is running, so ranks calling different collectives
// (or sizes) fail with Mismatch instead of exchanging wrong data.
struct WireHeader {
  uint32_t magic = kWireMagic;
  uint8_t kind = 0, dtype = 0, op = 0, flags = 0;
  uint64_t seq = 0;    // collective sequence number, or per-(peer, tag) message number
  uint64_t count = 0;  // element count of the operation's signature
  int32_t root = 0;
  int32_t tag = 0;
  uint64_t len = 0;    // payload bytes that follow
};
static_assert(sizeof(WireHeader) == 40, "wire header layout");

constexpr int kMaxStripes = 16;
// Payloads from this size on are striped over a remote peer's connections (TCP sockets, UCX
// endpoints); smaller ones go whole on the first.
constexpr size_t kStripeMinBytes = 256 << 10;

// Each peer has two independent streams: collective traffic, and send / recv (whose tags
// match out of order, so it must never wait behind a collective's bytes).
enum class Stream { COLL = 0, P2P = 1 };

class Channel;

// One message to send or receive. For a receive, `hdr` is what is expected; `got` is
// filled from the wire and checked before any payload byte is accepted.
struct Transfer {
  // FULL: the header must equal `hdr`. NONE: only the magic is checked (the caller reads the
  // header itself). SPLITS (all_to_all): the lengths (len, count) may differ from `hdr`;
  // a payload of another length is then drained unread (`drain`), so the exchange runs to
  // its end on every rank and the caller reports the disagreement afterwards (fail_splits).
  enum class Check { FULL, NONE, SPLITS };
  Channel* ch = nullptr;
  bool is_send = false;
  char* buf = nullptr;
  size_t len = 0;
  WireHeader hdr;
  WireHeader got;
  Check check = Check::FULL;
  bool with_header = true;  // false: payload only (its header was received separately)
  bool drain = false;       // the payload is read and dropped: `buf` is not touched
  size_t hdr_done = 0;
  size_t done = 0;                  // payload bytes moved in total
  size_t part_done[kMaxStripes] = {};  // per-socket progress of a striped TCP payload

  // A slot that moves nothing (already complete).
  static Transfer none() {
    Transfer t;
    t.with_header = false;
    return t;
  }
  bool header_complete() const { return !with_header || hdr_done == sizeof(WireHeader); }
  bool complete() const { return header_complete() && done == len; }
};

// One peer and stream, as a transport provides it (channels/README.md says what each call must do).
// The engine guarantees: one thread at a time calls a channel; transfers of one direction are
// progressed one after the other, each to completion, in the order they must appear on the
// wire; a transfer whose operation failed is handed to abandon() and never progressed again.
class Channel {
 public:
  explicit Channel(int peer) : peer_(peer) {}
  virtual ~Channel() = default;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int peer() const { return peer_; }
  // Move as many bytes of `t` as possible without blocking; true if any moved.
  // Throws CommError (PEER_FAILURE, MISMATCH) when the peer is gone or sent a wrong header.
  virtual bool progress(Transfer& t) = 0;
  // Checked right before the engine sleeps: true when progress(t) may move a byte without
  // the futex or an event on sockets(), so the engine must not sleep. Event-driven channels
  // arm their descriptor here (UCX: ucp_worker_arm) and answer true while events are due.
  virtual bool ready(const Transfer& t) const = 0;
  // Descriptors to poll() while idle; empty for shared memory, which sleeps on a futex.
  virtual const std::vector<int>& sockets() const = 0;
  // What poll() waits for on sockets() for a transfer of this direction. An event-driven
  // channel (one descriptor for all its completions) says POLLIN for sends too.
  virtual short poll_events(bool is_send) const { return is_send ? POLLOUT : POLLIN; }
  // True when bytes may arrive without the kernel noticing (a fabric's shared memory or RDMA
  // polled in user space, UCX's included): the engine then spins and yields before it
  // sleeps, as for shared memory, instead of sleeping in poll() at once as for sockets.
  virtual bool polled() const { return false; }
  // Wake a peer blocked on us (abort): it sees the connection drop.
  virtual void shutdown() {}
  // Said right before the channel is destroyed in a clean close, when the peer has already
  // closed (its goodbye or its hang-up was heard): nothing sent to it can matter now, so a
  // net closes without flushing towards it (UCX would report the flush's failure).
  virtual void peer_left() {}
  // True when everything the peer sent before its goodbye ('B' on the monitor socket) has
  // reached this channel by then, so a transfer that still cannot complete after a progress
  // pass never will (the engine then fails it with PEER_FAILURE instead of waiting out the
  // timeout). Shared memory answers through ready(); a net whose channels are closed, and
  // flushed, before the goodbye is sent (Engine::close) says true here. TCP sees the EOF.
  virtual bool flushed_before_goodbye() const { return false; }
  // `t` failed with its operation and is never progressed again: stop anything in flight
  // that still points at its buffer (the caller may free it next). Byte streams have nothing
  // in flight between progress() calls; a network channel cancels its requests.
  virtual void abandon(Transfer& t) { (void)t; }

 protected:
  int peer_;
};

// Throws MISMATCH unless `got` (from `peer`) matches `expected`; with check NONE only the
// magic is verified (the caller inspects the header itself).
void check_header(const WireHeader& got, const WireHeader& expected, int peer,
                  Transfer::Check check = Transfer::Check::FULL);
// What a channel calls once a receive's header is in: check_header as `t.check` says, or
// for SPLITS switch `t` to draining when the lengths differ.
void accept_header(Transfer& t, int peer);
// MISMATCH for an all_to_all receive whose header `got` disagrees with `expected` on lengths.
[[noreturn]] void fail_splits(const WireHeader& got, const WireHeader& expected, int peer);

}  // namespace comm
