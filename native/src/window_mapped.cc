#include "window_mapped.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "comm.h"
#include "shm.h"
#include "window.h"

namespace comm {

std::shared_ptr<WindowSegment> WindowSegment::allocate(uint64_t size) {
  std::shared_ptr<WindowSegment> s(new WindowSegment());
  s->size_ = size;
  s->mapped_ = std::max<size_t>(size, 1);
  s->fd_ = memfd_create("comm-window-memory", MFD_CLOEXEC);
  if (s->fd_ < 0) fail_errno("memfd_create (window memory)");
  if (fchmod(s->fd_, 0600) != 0 || ftruncate(s->fd_, static_cast<off_t>(s->mapped_)) != 0)
    fail_errno("window memory of " + std::to_string(size) + " bytes");
  // Every page now, so a host short of shared memory fails here, clearly, and not with a
  // SIGBUS in whichever peer first writes to a page that cannot be had.
  if (fallocate(s->fd_, 0, 0, static_cast<off_t>(s->mapped_)) != 0 && errno != EOPNOTSUPP)
    fail_errno("allocating " + std::to_string(size) + " bytes of shared memory for a window");
  void* p = mmap(nullptr, s->mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd_, 0);
  if (p == MAP_FAILED) fail_errno("mmap window memory");
  s->base_ = static_cast<char*>(p);  // fresh pages are zero
  return s;
}

WindowSegment::~WindowSegment() {
  if (base_) munmap(base_, mapped_);
  if (fd_ >= 0) ::close(fd_);
}

void PeerMappings::map(const Comm& c, const std::vector<WindowPeer>& peers, const std::vector<int>& fds) {
  unmap();
  bases_.clear();  // connect, once, before any put or get
  lens_.clear();
  if (fds.empty()) return;
  if (fds.size() != peers.size())
    fail(ErrorCode::INVALID_ARGUMENT, -1, "window: one memory descriptor per rank expected");
  bases_.assign(peers.size(), nullptr);
  lens_.assign(peers.size(), 0);
  for (int p = 0; p < static_cast<int>(peers.size()); p++) {
    if (fds[p] < 0 || p == c.rank || !c.shm || c.shm->local_index(p) < 0) continue;
    const std::string path = "/proc/" + std::to_string(peers[p].pid) + "/fd/" + std::to_string(fds[p]);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) fail_errno("cannot open the window memory of rank " + std::to_string(p) + " (" + path + ")");
    const size_t len = std::max<size_t>(peers[p].size, 1);
    struct stat st {};
    // At least the announced size: a smaller file would SIGBUS the first write past its end.
    const bool fits = fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= len;
    void* m = fits ? mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    ::close(fd);
    if (!fits)
      fail(ErrorCode::INVALID_ARGUMENT, p, path + " is not rank " + std::to_string(p) + "'s window memory of " +
                                               std::to_string(peers[p].size) + " bytes");
    if (m == MAP_FAILED) fail_errno("mmap the window memory of rank " + std::to_string(p));
    bases_[p] = static_cast<char*>(m);
    lens_[p] = len;
    any_ = true;
  }
}

void PeerMappings::unmap() {
  // Entries are nulled, never removed: Window::moves_in_call reads them without its lock.
  for (size_t p = 0; p < bases_.size(); p++) {
    char* base = bases_[p];
    bases_[p] = nullptr;
    if (base) munmap(base, lens_[p]);
  }
  any_ = false;
}

}  // namespace comm
