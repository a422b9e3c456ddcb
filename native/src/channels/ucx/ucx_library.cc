// Loading libucp and checking its version (ucx_library.h).
#include "channels/ucx/ucx_library.h"

#include <dlfcn.h>
#include <link.h>

#include <map>
#include <mutex>

namespace comm {

namespace {

const std::string kFloor = std::to_string(kUcxMajor) + "." + std::to_string(kUcxFloorMinor);
const std::string kRange = "UCX " + kFloor + " or a newer " + std::to_string(kUcxMajor) + ".x";
const std::string kPin = "pip install 'libucx-cu12>=" + kFloor + ",<" + std::to_string(kUcxMajor + 1) + "'";

}  // namespace

const Ucp& load_ucp(const NetOptions& opts) {
  static std::mutex mu;
  static std::map<std::string, Ucp> loaded;
  auto it = opts.find("library");
  const std::string path = it != opts.end() ? it->second : "libucp.so.0";
  std::lock_guard<std::mutex> lock(mu);
  auto [at, fresh] = loaded.try_emplace(path);
  Ucp& u = at->second;
  if (!fresh) return u;
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // never closed: UCX keeps threads
  if (!lib) {
    u.error = std::string("cannot load ") + path + ": " + dlerror();
    return u;
  }
  // The file the loader took (a soname resolves anywhere on the search path).
  std::string file = path;
  link_map* map = nullptr;
  if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name) file = map->l_name;
  // The version before the rest: a library older than the floor may lack a function of the
  // table, and its version says more than the missing name.
  using GetVersion = decltype(&::ucp_get_version);
  auto get_version = reinterpret_cast<GetVersion>(dlsym(lib, "ucp_get_version"));
  if (!get_version) {
    u.error = file + " has no ucp_get_version: it is not UCX's libucp";
    return u;
  }
  unsigned major = 0, minor = 0, release = 0;
  get_version(&major, &minor, &release);
  u.minor = minor;
  u.found = "UCX " + std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release) + " (" + file + ")";
  // Open MPI's wheel bundles a UCX of its own under the same sonames, and whichever loads
  // first wins: the file named here says which one this is.
  if (major != kUcxMajor || minor < kUcxFloorMinor) {
    u.error = u.found + " is not supported: the engine runs on " + kRange + " (" + kPin + ")";
    return u;
  }
#define COMM_UCP_RESOLVE(f)                                                  \
  u.f = reinterpret_cast<decltype(&::f)>(dlsym(lib, #f));                    \
  if (!u.f && u.error.empty()) u.error = u.found + " has no " #f;
  COMM_UCP_FUNCTIONS(COMM_UCP_RESOLVE)
#undef COMM_UCP_RESOLVE
  return u;
}

std::string ucx_unavailable(const NetOptions& opts) { return load_ucp(opts).error; }

std::string ucx_library(const NetOptions& opts) {
  const Ucp& u = load_ucp(opts);
  return u.error.empty() ? u.found + ": supported (the engine runs on " + kRange + ")" : u.error;
}

}  // namespace comm
