#include "channels/shm/memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
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

// MemAvailable of /proc/meminfo in bytes; SIZE_MAX where it cannot be read.
size_t available_bytes() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return SIZE_MAX;
  char line[128];
  size_t kib = SIZE_MAX;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "MemAvailable: %zu kB", &kib) == 1) break;
  std::fclose(f);
  return kib == SIZE_MAX ? kib : kib * 1024;
}

// Shared memory is not overcommitted, and a fallocate past what the host has does not fail:
// the kernel's OOM killer takes some process instead (ours or any other). Large segments are
// reserved a step at a time while the host keeps a floor free, so ranks of a host that each
// ask for a fair share at once get ENOMEM, not the OOM killer. Huge pages come from their own
// pool, whose end fallocate reports itself (ENOSPC).
int reserve_pages(int fd, size_t bytes, unsigned flags) {
  constexpr size_t kStep = size_t{1} << 30, kFloor = size_t{512} << 20;
  if (bytes <= kStep || (flags & MFD_HUGETLB)) return fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  for (size_t done = 0; done < bytes; done += kStep) {
    const size_t step = std::min(kStep, bytes - done);
    const size_t have = available_bytes();
    if (have != SIZE_MAX && have < step + kFloor) {
      errno = ENOMEM;
      return -1;
    }
    if (fallocate(fd, 0, static_cast<off_t>(done), static_cast<off_t>(step)) != 0) return -1;
  }
  return 0;
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
  else if (o.reserve && reserve_pages(fd, bytes, o.flags) != 0 && errno != EOPNOTSUPP) call = "fallocate";
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
