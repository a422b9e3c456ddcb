// A network: how one communicator reaches its peers through a fabric library (UCX, verbs),
// in the shape of NCCL's net plugin and gloo's transport/device: open it, publish its
// address through the rendezvous store, connect each peer from that peer's address. What
// it connects is an ordinary Channel, so every algorithm runs over it unchanged.
// channels/README.md describes the contract; net.cc holds the table of nets this build has.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "channels/channel.h"
#include "windows/rma.h"

namespace comm {

struct NetCaps {
  bool host_memory = true;     // moves buffers in host memory
  bool device_memory = false;  // moves buffers in GPU memory (CUDA-aware fabric)
  uint64_t max_message = UINT64_MAX;  // largest payload one transfer may carry
};

// Key / value settings from the Python side (e.g. "library": the shared library to load).
using NetOptions = std::map<std::string, std::string>;

class Net {
 public:
  virtual ~Net() = default;
  Net(const Net&) = delete;
  Net& operator=(const Net&) = delete;

  virtual NetCaps caps() const = 0;
  // This rank's address, opaque bytes: published through the store, given to connect().
  virtual std::string address() const = 0;
  // The channel of `stream` to `peer`, whose address() is `remote`. same_host: the peer runs
  // on this host (the net may pick shared-memory paths, which may rule out its own failure
  // detection: the engine's monitor sockets report a dead peer either way).
  virtual std::unique_ptr<Channel> connect(int peer, Stream stream, const std::string& remote,
                                           bool same_host) = 0;
  // Memory registration (RDMA): a handle for [buf, buf + len), or null when the net needs
  // none. Channels call it through their own registration cache; released by deregister.
  virtual void* register_memory(void* buf, size_t len) {
    (void)buf, (void)len;
    return nullptr;
  }
  virtual void deregister_memory(void* handle) { (void)handle; }
  // One-sided (rma.h): a window's memory registered for the peers to reach by RMA, or null
  // where the net has no RMA or cannot register that memory (the window then sends messages).
  virtual std::unique_ptr<RmaWindow> rma_window(const RmaMemory& mem) {
    (void)mem;
    return nullptr;
  }
  // What the library sees on this machine (transports, devices), for `python -m comm.doctor`.
  virtual std::string describe() const = 0;
  // In a forked child: drop the parent's library state without touching it (no goodbye,
  // no close of what the parent shares). Channels of this net are leaked the same way.
  virtual void forget() {}

 protected:
  Net() = default;
};

// Why net `name` cannot be opened here (not built, library missing or too old), or empty.
std::string net_unavailable(const std::string& name, const NetOptions& opts);
// The library net `name` loads: its version and file, and whether the engine supports it;
// else why it cannot say (as net_unavailable).
std::string net_library(const std::string& name, const NetOptions& opts);
// Opens net `name` for `rank` of `size`; throws SYSTEM naming the cause when it cannot.
std::unique_ptr<Net> open_net(const std::string& name, int rank, int size, const NetOptions& opts);

}  // namespace comm
