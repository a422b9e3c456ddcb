// libibverbs for the verbs net (verbs.cc) and its windows (window_verbs.cc): the library loaded
// at run time, port discovery, the opened device and registered regions. Internal to the net;
// needs rdma-core's headers.
#pragma once

#include <infiniband/verbs.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/common.h"

namespace comm::verbs {

// The verbs net cannot run here; what() says why (no library, no device, no active port).
struct Unavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The exported functions of libibverbs.so.1; ibv_post_send, ibv_post_recv, ibv_poll_cq and
// ibv_req_notify_cq are inline calls through the context's ops table and need no symbol.
struct Lib {
  decltype(&::ibv_get_device_list) get_device_list;
  decltype(&::ibv_free_device_list) free_device_list;
  decltype(&::ibv_get_device_name) get_device_name;
  decltype(&::ibv_open_device) open_device;
  decltype(&::ibv_close_device) close_device;
  decltype(&::ibv_query_device) query_device;
  decltype(&::ibv_query_port) query_port;  // the exported (compat) symbol: see port_attr()
  decltype(&::ibv_query_gid) query_gid;
  decltype(&::_ibv_query_gid_ex) query_gid_ex;  // rdma-core >= 32; null before (type unknown)
  decltype(&::ibv_alloc_pd) alloc_pd;
  decltype(&::ibv_dealloc_pd) dealloc_pd;
  decltype(&::ibv_reg_mr) reg_mr;
  decltype(&::ibv_dereg_mr) dereg_mr;
  decltype(&::ibv_create_comp_channel) create_comp_channel;
  decltype(&::ibv_destroy_comp_channel) destroy_comp_channel;
  decltype(&::ibv_create_cq) create_cq;
  decltype(&::ibv_destroy_cq) destroy_cq;
  decltype(&::ibv_get_cq_event) get_cq_event;
  decltype(&::ibv_ack_cq_events) ack_cq_events;
  decltype(&::ibv_create_qp) create_qp;
  decltype(&::ibv_modify_qp) modify_qp;
  decltype(&::ibv_destroy_qp) destroy_qp;
  decltype(&::ibv_wc_status_str) wc_status_str;
};

// Loads libibverbs.so.1 on first use; throws Unavailable when it cannot (not installed, too old).
const Lib& lib();

struct PortInfo {
  std::string device;
  int port = 0;
  uint16_t lid = 0;
  uint8_t mtu = 0;        // enum ibv_mtu code
  bool ethernet = false;  // RoCE: addressed by GID
  int gid_index = 0;
  uint8_t gid[16] = {};
};

// The first ACTIVE port, of device `wanted` ("name" or "name:port") when given; gid_index -1
// picks one (choose_gid). Throws Unavailable naming the reason.
PortInfo find_port(const std::string& wanted, int gid_index);
// One line per port of every RDMA device (state, link layer, LID, MTU, GIDs).
std::vector<std::string> describe_ports();

// ibv_get_device_list as an object; throws Unavailable when no device is listed.
struct DeviceList {
  ibv_device** list = nullptr;
  int n = 0;
  DeviceList();
  ~DeviceList();
  DeviceList(const DeviceList&) = delete;
  DeviceList& operator=(const DeviceList&) = delete;
};

// ---- the device a communicator opened; channels share it and keep it alive ------------------------
struct Device {
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  // RDMA READs a queue pair may serve / issue at once (ibv_query_device; 1 if it cannot say).
  int max_qp_rd_atom = 1, max_qp_init_rd_atom = 1;
  explicit Device(const std::string& name) {
    DeviceList devices;
    for (int d = 0; d < devices.n && !ctx; d++)
      if (name == lib().get_device_name(devices.list[d])) ctx = lib().open_device(devices.list[d]);
    if (!ctx) fail(ErrorCode::SYSTEM, -1, "cannot open RDMA device " + name + ": " + std::strerror(errno));
    pd = lib().alloc_pd(ctx);
    if (!pd) {
      lib().close_device(ctx);
      fail_errno("ibv_alloc_pd");
    }
    ibv_device_attr attr{};
    if (lib().query_device(ctx, &attr) == 0) {
      max_qp_rd_atom = attr.max_qp_rd_atom;
      max_qp_init_rd_atom = attr.max_qp_init_rd_atom;
    }
  }
  ~Device() {
    lib().dealloc_pd(pd);
    lib().close_device(ctx);
  }
};

// Page-aligned memory registered with the device for the life of a channel (or a window's
// staging chunks).
class Region {
 public:
  Region(Device& dev, size_t bytes, int access) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail_errno("mmap of a verbs ring or staging area");
    base_ = static_cast<char*>(p);
    // A forked child gets no copy: the NIC keeps writing the parent's pages, never a child's
    // copy-on-write one (what ibv_fork_init does for every registration).
    madvise(base_, bytes, MADV_DONTFORK);
    mr_ = lib().reg_mr(dev.pd, base_, bytes, access);
    if (!mr_) {
      const int err = errno;
      munmap(base_, bytes_);
      errno = err;
      fail_errno("ibv_reg_mr of a verbs ring or staging area");
    }
  }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region() {
    lib().dereg_mr(mr_);
    munmap(base_, bytes_);
  }
  char* base() const { return base_; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }

 private:
  size_t bytes_;
  char* base_ = nullptr;
  ibv_mr* mr_ = nullptr;
};

}  // namespace comm::verbs
