// libucp for the UCX net (ucx.cc): loaded at run time (dlopen) from the library the Python
// side names, and checked against the UCX versions the engine runs on.
//
// The oldest is 1.kUcxFloorMinor; every newer 1.x will do, whatever version the headers of the
// build had. Every function of the table below, and every field, flag and status the net sets
// or reads, has the same name, value and offset in UCX's headers from 1.14 to 1.22 (compared in
// the libucx wheels' headers; UCX keeps its 1.x ABI, and an older library reads only the fields
// a field mask names), and the net asks ucp_init for the floor's API. 1.14 is the oldest libucx
// wheel; tests/test_ucx_versions.py runs jobs on it. pyproject.toml pins the same floor.
#pragma once

#include <ucp/api/ucp.h>

#include <string>

#include "channels/net.h"

namespace comm {

constexpr unsigned kUcxMajor = 1, kUcxFloorMinor = 14;
static_assert(UCP_API_MAJOR == kUcxMajor && UCP_API_MINOR >= kUcxFloorMinor,
              "UCX's headers are older than the floor the engine runs on (ucx_library.h: kUcxFloorMinor)");
// Newer than the floor, so asked of the loaded library's version: the first UCX that fills a
// receive's information when it completes at once, and the first whose ucp_config_modify
// reaches its transports' settings (UCX_TCP_*).
constexpr unsigned kUcxImmediateInfoMinor = 16, kUcxTransportSettingsMinor = 17;

#define COMM_UCP_FUNCTIONS(X)                                                                  \
  X(ucp_config_read) X(ucp_config_modify) X(ucp_config_release) X(ucp_init_version)           \
  X(ucp_cleanup) X(ucp_context_print_info) X(ucp_worker_create) X(ucp_worker_destroy)         \
  X(ucp_worker_query) X(ucp_worker_release_address) X(ucp_worker_progress)                    \
  X(ucp_worker_get_efd) X(ucp_worker_arm) X(ucp_ep_create) X(ucp_ep_close_nbx)                \
  X(ucp_tag_send_nbx) X(ucp_tag_recv_nbx) X(ucp_request_check_status)                         \
  X(ucp_tag_recv_request_test) X(ucp_request_cancel) X(ucp_request_free) X(ucs_status_string)  \
  X(ucp_mem_map) X(ucp_mem_unmap) X(ucp_rkey_pack) X(ucp_rkey_buffer_release)                 \
  X(ucp_ep_rkey_unpack) X(ucp_rkey_destroy) X(ucp_put_nbx) X(ucp_get_nbx)                      \
  X(ucp_ep_flush_nbx)

// libucp's entry points, resolved once per library path.
struct Ucp {
#define COMM_UCP_POINTER(f) decltype(&::f) f = nullptr;
  COMM_UCP_FUNCTIONS(COMM_UCP_POINTER)
#undef COMM_UCP_POINTER
  unsigned minor = 0;  // of its version (the major is kUcxMajor once it loaded)
  std::string found;  // "UCX <version> (<file>)", once loaded
  std::string error;  // why it cannot be used; empty when it can
};

// The library of opts["library"] (default: libucp.so.0 from the loader's search path).
const Ucp& load_ucp(const NetOptions& opts);

}  // namespace comm
