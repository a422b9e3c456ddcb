// Port discovery for the verbs net, and libibverbs loaded at run time (NCCL's ibvwrap does
// the same): the extension never depends on rdma-core, and says why verbs cannot run here.
#include <dlfcn.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "channels/verbs/verbs_ibv.h"
#include "channels/verbs/verbs_wire.h"

namespace comm::verbs {

// ---- libibverbs, loaded at run time ---------------------------------------------------------
namespace {
std::string load_error;
}  // namespace

const Lib& lib() {
  static const Lib* loaded = [] () -> const Lib* {
    void* h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      load_error = std::string("libibverbs.so.1 cannot be loaded (") + dlerror() +
            "): install rdma-core's verbs library (apt-get install libibverbs1 rdma-core)";
      return nullptr;
    }
    static Lib l;
    bool ok = true;
    auto sym = [&](auto& fn, const char* name, bool required = true) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn && required) {
        ok = false;
        load_error = std::string("libibverbs.so.1 lacks ") + name + " (rdma-core too old)";
      }
    };
    sym(l.get_device_list, "ibv_get_device_list");
    sym(l.free_device_list, "ibv_free_device_list");
    sym(l.get_device_name, "ibv_get_device_name");
    sym(l.open_device, "ibv_open_device");
    sym(l.close_device, "ibv_close_device");
    sym(l.query_device, "ibv_query_device");
    sym(l.query_port, "ibv_query_port");
    sym(l.query_gid, "ibv_query_gid");
    sym(l.query_gid_ex, "_ibv_query_gid_ex", false);
    sym(l.alloc_pd, "ibv_alloc_pd");
    sym(l.dealloc_pd, "ibv_dealloc_pd");
    sym(l.reg_mr, "ibv_reg_mr");
    sym(l.dereg_mr, "ibv_dereg_mr");
    sym(l.create_comp_channel, "ibv_create_comp_channel");
    sym(l.destroy_comp_channel, "ibv_destroy_comp_channel");
    sym(l.create_cq, "ibv_create_cq");
    sym(l.destroy_cq, "ibv_destroy_cq");
    sym(l.get_cq_event, "ibv_get_cq_event");
    sym(l.ack_cq_events, "ibv_ack_cq_events");
    sym(l.create_qp, "ibv_create_qp");
    sym(l.modify_qp, "ibv_modify_qp");
    sym(l.destroy_qp, "ibv_destroy_qp");
    sym(l.wc_status_str, "ibv_wc_status_str");
    return ok ? &l : nullptr;
  }();
  if (!loaded) throw Unavailable(load_error);
  return *loaded;
}

namespace {

// verbs.h's ___ibv_query_port, through the loaded symbol: the extended query when the
// provider has one, else the exported compat call on a zeroed attribute.
int port_attr(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) {
  verbs_context* vctx = verbs_get_ctx_op(ctx, query_port);
  if (!vctx) {
    std::memset(attr, 0, sizeof *attr);
    return lib().query_port(ctx, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
  }
  return vctx->query_port(ctx, port, attr, sizeof *attr);
}

struct Context {
  ibv_context* ctx;
  explicit Context(ibv_device* d) : ctx(lib().open_device(d)) {
    if (!ctx) throw Unavailable(std::string("cannot open ") + lib().get_device_name(d) + ": " + std::strerror(errno));
  }
  ~Context() { lib().close_device(ctx); }
};

}  // namespace

DeviceList::DeviceList() {
  list = lib().get_device_list(&n);
  // No kernel RDMA support at all (ENOSYS) is the same answer as an empty list.
  if (!list || n == 0) {
    if (list) lib().free_device_list(list);
    throw Unavailable("no RDMA device (the kernel lists no InfiniBand/RoCE device)");
  }
}

DeviceList::~DeviceList() { lib().free_device_list(list); }

namespace {

std::vector<GidEntry> gid_table(ibv_context* ctx, int port, int length) {
  std::vector<GidEntry> table;
  for (int i = 0; i < length; i++) {
    GidEntry e{i, {}, -1};
    if (lib().query_gid_ex) {
      ibv_gid_entry entry{};
      if (lib().query_gid_ex(ctx, port, i, &entry, 0, sizeof entry)) continue;  // unpopulated
      std::memcpy(e.gid, entry.gid.raw, 16);
      e.type = static_cast<int>(entry.gid_type);
    } else {
      ibv_gid gid;
      if (lib().query_gid(ctx, port, i, &gid)) continue;
      std::memcpy(e.gid, gid.raw, 16);
    }
    table.push_back(e);
  }
  return table;
}

std::string gid_text(const uint8_t* g) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", g[0],
                g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15]);
  return buf;
}
}  // namespace

// The first ACTIVE port, of device `wanted` ("name" or "name:port") when given; gid_index -1
// picks one (choose_gid). Throws Unavailable naming the reason.
PortInfo find_port(const std::string& wanted, int gid_index) {
  DeviceList devices;
  const size_t colon = wanted.find(':');
  const std::string want_dev = wanted.substr(0, colon);
  const int want_port = colon == std::string::npos ? 0 : std::atoi(wanted.c_str() + colon + 1);
  std::string names, seen;
  for (int d = 0; d < devices.n; d++) {
    const std::string name = lib().get_device_name(devices.list[d]);
    names += (names.empty() ? "" : ", ") + name;
    if (!want_dev.empty() && name != want_dev) continue;
    Context c(devices.list[d]);
    ibv_device_attr dattr{};
    if (lib().query_device(c.ctx, &dattr)) continue;
    for (int port = 1; port <= dattr.phys_port_cnt; port++) {
      if (want_port && port != want_port) continue;
      ibv_port_attr attr;
      if (port_attr(c.ctx, static_cast<uint8_t>(port), &attr)) continue;
      seen += (seen.empty() ? "" : ", ") + name + ":" + std::to_string(port);
      if (attr.state != IBV_PORT_ACTIVE) continue;
      PortInfo p;
      p.device = name;
      p.port = port;
      p.lid = attr.lid;
      p.mtu = static_cast<uint8_t>(attr.active_mtu);
      p.ethernet = attr.link_layer == IBV_LINK_LAYER_ETHERNET;
      const bool scan = p.ethernet && gid_index < 0;
      p.gid_index = choose_gid(scan ? gid_table(c.ctx, port, attr.gid_tbl_len) : std::vector<GidEntry>{},
                               p.ethernet, gid_index);
      ibv_gid gid;
      if (lib().query_gid(c.ctx, port, p.gid_index, &gid))
        throw Unavailable(name + ":" + std::to_string(port) + " has no GID at index " + std::to_string(p.gid_index) +
                          " (COMM_VERBS_GID_INDEX)");
      std::memcpy(p.gid, gid.raw, 16);
      return p;
    }
  }
  if (seen.empty())
    throw Unavailable("no RDMA device matches COMM_VERBS_DEVICE='" + wanted + "'; devices here: " + names);
  throw Unavailable("no active RDMA port (checked " + seen + "); is the link up?");
}

// One line per port of every RDMA device (state, link layer, LID, MTU, GIDs).
std::vector<std::string> describe_ports() {
  DeviceList devices;
  std::vector<std::string> lines;
  for (int d = 0; d < devices.n; d++) {
    const std::string name = lib().get_device_name(devices.list[d]);
    Context c(devices.list[d]);
    ibv_device_attr dattr{};
    if (lib().query_device(c.ctx, &dattr)) continue;
    for (int port = 1; port <= dattr.phys_port_cnt; port++) {
      ibv_port_attr attr;
      if (port_attr(c.ctx, static_cast<uint8_t>(port), &attr)) continue;
      std::string line = name + ":" + std::to_string(port) +
                         (attr.state == IBV_PORT_ACTIVE ? " active" : " not active") +
                         (attr.link_layer == IBV_LINK_LAYER_ETHERNET ? " RoCE" : " InfiniBand") +
                         " lid " + std::to_string(attr.lid) + " mtu " + std::to_string(128 << attr.active_mtu);
      for (const GidEntry& e : gid_table(c.ctx, port, attr.gid_tbl_len)) {
        bool zero = true;
        for (uint8_t b : e.gid) zero = zero && b == 0;
        if (zero) continue;
        static const char* const types[] = {"IB", "RoCEv1", "RoCEv2"};
        line += "; gid[" + std::to_string(e.index) + "] " + gid_text(e.gid) +
                (e.type >= 0 && e.type <= 2 ? std::string(" ") + types[e.type] : "");
      }
      lines.push_back(line);
    }
  }
  return lines;
}


}  // namespace comm::verbs
