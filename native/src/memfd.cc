#include "memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace comm {

namespace {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it (EINVAL) and fault in
#endif

char* map_shared(int fd, size_t bytes, bool populate) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
  if (p == MAP_FAILED) return nullptr;
  if (populate) (void)madvise(p, bytes, MADV_POPULATE_WRITE);
  return static_cast<char*>(p);
}

void close_keeping_errno(int fd) {
  const int err = errno;
  ::close(fd);
  errno = err;
}

}  // namespace

Memfd try_create_memfd(const char* name, size_t bytes, const MemfdOptions& o, const char** failed) {
  Memfd m;
  const int fd = memfd_create(name, MFD_CLOEXEC | o.flags);
  const char* call = nullptr;
  if (fd < 0) call = "memfd_create";
  else if (fchmod(fd, 0600) != 0) call = "fchmod";
  else if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) call = "ftruncate";
  else if (o.reserve && fallocate(fd, 0, 0, static_cast<off_t>(bytes)) != 0 && errno != EOPNOTSUPP) call = "fallocate";
  else if ((m.base = map_shared(fd, bytes, o.populate)) == nullptr) call = "mmap";
  if (call) {
    if (fd >= 0) close_keeping_errno(fd);
    if (failed) *failed = call;
    return Memfd{};
  }
  m.fd = fd;
  m.bytes = bytes;
  return m;
}

Memfd create_memfd(const char* name, size_t bytes, const MemfdOptions& o, const std::string& what) {
  const char* failed = "";
  Memfd m = try_create_memfd(name, bytes, o, &failed);
  if (m.fd < 0) fail_errno(what + ": " + failed);
  return m;
}

Memfd map_peer_memfd(const PeerMemfd& peer) {
  const std::string whose = "the " + std::string(peer.what) + " of rank " + std::to_string(peer.rank);
  const std::string path = "/proc/" + std::to_string(peer.pid) + "/fd/" + std::to_string(peer.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) fail_errno("cannot open " + whose + " (" + path + "; the rank exited, or runs as another user)");
  struct stat st {};
  const bool known = fstat(fd, &st) == 0;
  const std::string why = known ? "it has " + std::to_string(st.st_size) : std::string("fstat: ") + std::strerror(errno);
  const size_t size = known ? static_cast<size_t>(st.st_size) : 0;
  const bool fits = known && (peer.exact ? size == peer.bytes : size >= peer.bytes);
  Memfd m;
  m.bytes = peer.exact ? peer.bytes : size;
  m.base = fits ? map_shared(fd, m.bytes, peer.populate) : nullptr;
  close_keeping_errno(fd);  // the mapping keeps the segment
  if (!fits)
    fail(peer.mismatch, peer.rank, path + " is not rank " + std::to_string(peer.rank) + "'s " + peer.what + " of " +
                                       std::to_string(peer.bytes) + " bytes (" + why + ")" + peer.mismatch_hint);
  if (!m.base) fail_errno("mmap " + whose);
  return m;
}

void release_memfd(Memfd& m) {
  if (m.base) munmap(m.base, m.bytes);
  if (m.fd >= 0) ::close(m.fd);
  m = Memfd{};
}

}  // namespace comm
