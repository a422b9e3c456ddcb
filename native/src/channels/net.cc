// The table of nets: adding one is a row here and its own file (ucx.cc, verbs.cc).
#include "channels/net.h"

#include <cstring>

namespace comm {

struct NetEntry {
  const char* name;
  std::string (*unavailable)(const NetOptions&);
  std::unique_ptr<Net> (*open)(int rank, int size, const NetOptions&);
  std::string (*library)(const NetOptions&);  // null: the net says nothing of its library
};

#ifdef COMM_HAVE_UCX
std::string ucx_unavailable(const NetOptions& opts);
std::unique_ptr<Net> open_ucx(int rank, int size, const NetOptions& opts);
std::string ucx_library(const NetOptions& opts);
#endif
#ifdef COMM_HAVE_VERBS
std::string verbs_unavailable(const NetOptions& opts);
std::unique_ptr<Net> open_verbs(int rank, int size, const NetOptions& opts);
#endif

namespace {

constexpr NetEntry kNets[] = {
#ifdef COMM_HAVE_UCX
    {"ucx", ucx_unavailable, open_ucx, ucx_library},
#endif
#ifdef COMM_HAVE_VERBS
    {"verbs", verbs_unavailable, open_verbs, nullptr},
#endif
    {nullptr, nullptr, nullptr, nullptr},
};

// Nets left out of this build, and why (CMake says: the headers were not found).
constexpr const char* kSkipped[][2] = {
#ifdef COMM_UCX_SKIPPED
    {"ucx", COMM_UCX_SKIPPED},
#endif
#ifdef COMM_VERBS_SKIPPED
    {"verbs", COMM_VERBS_SKIPPED},
#endif
    {nullptr, nullptr},
};

const NetEntry* find(const std::string& name) {
  for (const NetEntry& e : kNets)
    if (e.name && name == e.name) return &e;
  return nullptr;
}

}  // namespace

std::string net_unavailable(const std::string& name, const NetOptions& opts) {
  if (const NetEntry* e = find(name)) return e->unavailable(opts);
  for (const auto& s : kSkipped)
    if (s[0] && name == s[0]) return "the engine was built without it (" + std::string(s[1]) + ")";
  return "no net named '" + name + "' in the engine";
}

std::string net_library(const std::string& name, const NetOptions& opts) {
  const NetEntry* e = find(name);
  return e && e->library ? e->library(opts) : net_unavailable(name, opts);
}

std::unique_ptr<Net> open_net(const std::string& name, int rank, int size, const NetOptions& opts) {
  const std::string why = net_unavailable(name, opts);
  if (!why.empty()) fail(ErrorCode::SYSTEM, -1, "cannot open net " + name + ": " + why);
  return find(name)->open(rank, size, opts);
}

}  // namespace comm
