// Remote memory access for windows (window.h): a net whose fabric reaches a peer's registered
// memory itself (UCX: ucp_put_nbx / ucp_get_nbx with exchanged rkeys; verbs: RDMA WRITE / READ)
// serves a window's puts and gets without any message of the engine's own; a signal, after
// the data before it completed, is a message unless the net adds it itself (put). Net::rma_window offers it; a
// net without RMA (or memory it cannot register) returns null, and the window keeps the p2p
// message path for those peers. UCX's net (window_ucx.cc) and the verbs net (window_verbs.cc,
// RDMA WRITE / READ) offer it when opened with COMM_WINDOW_RMA=1.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace comm {

// This rank's memory a window exposes.
struct RmaMemory {
  char* base;
  uint64_t size;
};

// How the window waits for an RMA completion: until done() (checked under the engine's lock),
// driving the engine meanwhile (its driver progresses the net), and throwing on a dead or
// aborted peer, Ctrl-C or the bound.
using RmaWait = std::function<void(const std::function<bool()>& done)>;

class RmaWindow {
 public:
  virtual ~RmaWindow() = default;
  // What every peer needs to reach this rank's memory (addresses, packed keys): exchanged
  // at creation, then connect() gets every rank's, in rank order (this rank's included).
  virtual const std::string& key() const = 0;
  virtual void connect(const std::vector<std::string>& keys) = 0;
  // Whether `peer` is reached by RMA (its key came, and this net connects to it). Before
  // each of the calls below the engine has connected the peer's p2p channel.
  virtual bool reaches(int peer) const = 0;
  // Non-blocking (complete after flush()), except that a signal adds 1 to the peer's
  // counter k only after this put's data and every earlier operation of this rank to it
  // completed: the call may wait for that, as flush() does. False: the net cannot add to
  // that peer's counters itself; everything before is complete, and the caller sends the
  // signal (a message the target's engine counts in).
  // Either may also wait (through `wait`) while the net's staging or queue has no room.
  virtual bool put(int peer, const void* src, uint64_t len, uint64_t offset, int signal, const RmaWait& wait) = 0;
  // dst must stay valid until flush() returns (the bytes may be copied into it until then).
  virtual void get(int peer, void* dst, uint64_t len, uint64_t offset, const RmaWait& wait) = 0;
  // Every put / get / signal to `peer` (-1: every peer) complete at both ends.
  virtual void flush(int peer, const RmaWait& wait) = 0;
  // Nothing issued to `peer` (-1: any peer) since its last flush: flush has nothing to wait for.
  virtual bool flushed(int peer) = 0;
  // The keys and registrations go: nothing reaches this memory through them afterwards.
  virtual void close() = 0;
};

}  // namespace comm
