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

namespace {

constexpr size_t kHugePage = 2 << 20;

// A memfd of `bytes` with every page allocated now (so a host short of memory fails here,
// clearly, and not with a SIGBUS in whichever peer first writes to a page that cannot be
// had), or -1 with errno set.
int allocated_memfd(unsigned flags, size_t bytes) {
  const int fd = memfd_create("comm-window-memory", MFD_CLOEXEC | flags);
  if (fd < 0) return -1;
  if (fchmod(fd, 0600) == 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0 &&
      (fallocate(fd, 0, 0, static_cast<off_t>(bytes)) == 0 || errno == EOPNOTSUPP))
    return fd;
  const int err = errno;
  ::close(fd);
  errno = err;
  return -1;
}

}  // namespace

std::shared_ptr<WindowSegment> WindowSegment::allocate(uint64_t size) {
  std::shared_ptr<WindowSegment> s(new WindowSegment());
  s->size_ = size;
  // 2 MiB pages where the host has a pool of them (vm.nr_hugepages), else 4 KiB pages: a
  // 64 MiB copy into 4 KiB shared pages ran at 12 GB/s, into private memory on transparent
  // huge pages at 18 (one process; the TLB). Hosts with shmem_enabled=advise take the hint.
  if (size >= kHugePage) {
    s->mapped_ = (size + kHugePage - 1) / kHugePage * kHugePage;
    s->fd_ = allocated_memfd(MFD_HUGETLB, s->mapped_);
  }
  if (s->fd_ < 0) {
    s->mapped_ = std::max<size_t>(size, 1);
    s->fd_ = allocated_memfd(0, s->mapped_);
    if (s->fd_ < 0) fail_errno("allocating " + std::to_string(size) + " bytes of shared memory for a window");
  }
  void* p = mmap(nullptr, s->mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd_, 0);
  if (p == MAP_FAILED) fail_errno("mmap window memory");
  if (s->mapped_ >= kHugePage) (void)madvise(p, s->mapped_, MADV_HUGEPAGE);
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
    struct stat st {};
    // At least the announced size: a smaller file would SIGBUS the first write past its end.
    // Mapped whole (a huge-page file's length is whole pages, as mmap and munmap want there).
    const bool fits = fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= std::max<uint64_t>(peers[p].size, 1);
    const size_t len = fits ? static_cast<size_t>(st.st_size) : 0;
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
