// Windows over UCX RMA (rma.h): what the UCX net (ucx.cc) shares with its windows
// (window_ucx.cc). Its p2p worker carries the RMA, on the endpoint of each peer's p2p channel.
//
// Lifetimes, all under the hub's lock: an rkey is unpacked on one endpoint and must be
// destroyed before that endpoint closes (UCX's rule), so a closing p2p channel first has the
// hub destroy every rkey on its endpoint; the net's teardown releases every window's
// registrations before the worker and the context go; a window closed by its owner destroys
// its rkeys and unmaps its memory. A window that outlives its net fails its calls with CLOSED.
#pragma once

#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "windows/rma.h"
#include "channels/ucx/ucx_library.h"

namespace comm {

class UcxRmaWindow;

struct UcxRmaHub {
  UcxRmaHub(const Ucp& u, ucp_context_h ctx, ucp_worker_h worker) : u(u), ctx(ctx), worker(worker) {}
  const Ucp& u;
  const ucp_context_h ctx;
  const ucp_worker_h worker;  // the p2p worker (thread mode MULTI: the windows' callers use it too)
  std::mutex mu;
  std::vector<ucp_ep_h> eps;        // by peer: its p2p channel's endpoint, null until connected
  std::set<UcxRmaWindow*> windows;  // open ones
  bool released = false;            // the net tore down: worker and context are gone

  void endpoint(int peer, ucp_ep_h ep);  // a p2p channel connected
  void endpoint_closing(int peer);       // ... is about to close its endpoint
  void release();                        // the net is about to destroy the worker
};

// This rank's window memory registered with the hub's context, or null when UCX cannot map it
// (the window then sends messages).
std::unique_ptr<RmaWindow> open_ucx_rma_window(const std::shared_ptr<UcxRmaHub>& hub, const RmaMemory& mem);

// A UCX failure as the engine's error (truncation MISMATCH, timeouts TIMEOUT, else
// PEER_FAILURE naming `peer`).
[[noreturn]] void fail_status(const Ucp& u, ucs_status_t st, int peer, const char* what);

}  // namespace comm
