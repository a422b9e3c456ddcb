// Windows over verbs RMA (rma.h): what the verbs net (verbs.cc) shares with its windows
// (window_verbs.cc). RDMA WRITE and READ go on the queue pair of each peer's p2p channel: it is
// connected already (on first use, as the engine connects p2p), RC completes in order on it,
// and plain WRITE / READ consume no receive request of the peer's ring. Their completions come
// on that channel's queue, which the engine polls whenever it drives p2p (a window's flush
// drives it): the channel hands every completion whose id carries kRmaWrTag to the hub.
//
// Lifetimes, all under the hub's lock: a channel detaches its queue pair before destroying it
// (no window posts on it afterwards) and says so again after it is destroyed (work still in
// flight on it is then over: its staging chunks are free, its window's next flush fails); the
// net's teardown releases every window's registrations; a window closed by its owner
// deregisters its memory at once, and its staging area when nothing is in flight on it (else
// the hub keeps it until the queue pairs are gone).
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "windows/rma.h"
#include "channels/verbs/verbs_ibv.h"

namespace comm::verbs {

class VerbsRmaWindow;

struct VerbsRmaHub {
  VerbsRmaHub(std::shared_ptr<Device> dev, int ranks) : dev(std::move(dev)), qps(ranks, nullptr), busy(ranks, 0) {}
  // RMA work requests a p2p queue pair may hold beyond the channel's own (verbs.cc adds them
  // to its send queue and completion queue).
  static constexpr uint32_t kDepth = 32;

  const std::shared_ptr<Device> dev;
  std::mutex mu;
  std::vector<ibv_qp*> qps;                       // by peer: its p2p channel's queue pair once at RTS
  std::vector<uint32_t> busy;                     // by peer: RMA work requests on it not yet completed
  std::map<uint32_t, VerbsRmaWindow*> windows;    // open ones, by id (the work-request id's field)
  uint32_t next_id = 1;
  std::vector<std::unique_ptr<Region>> orphans;  // staging of closed windows that had work in flight
  bool released = false;                          // the net tore down

  void connected(int peer, ibv_qp* qp);  // the p2p channel to `peer` reached RTS
  void detach(int peer);                 // ... is about to destroy its queue pair
  void detached(int peer);               // ... destroyed it: what was in flight on it is lost
  // An RMA completion (is_rma_wr) polled by the p2p channel to `peer` (the engine's lock held).
  void completed(int peer, const ibv_wc& wc);
  void release();                        // the net is going
};

// This rank's window memory registered with the net's device, or null when it cannot be (the
// window then sends messages).
std::unique_ptr<RmaWindow> open_verbs_rma_window(const std::shared_ptr<VerbsRmaHub>& hub, const RmaMemory& mem,
                                                 int rank);

}  // namespace comm::verbs
