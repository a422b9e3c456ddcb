#include "windows/window_mapped.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "core/comm.h"
#include "channels/shm/memfd.h"
#include "channels/shm/shm.h"
#include "windows/window.h"

namespace comm {

namespace {
constexpr size_t kHugePage = 2 << 20;
}  // namespace

std::shared_ptr<WindowSegment> WindowSegment::allocate(uint64_t size) {
  std::shared_ptr<WindowSegment> s(new WindowSegment());
  s->size_ = size;
  // Every page allocated now (reserve): peers write into it, and a page that cannot be had
  // would SIGBUS whichever of them touches it first.
  MemfdOptions o;
  o.reserve = true;
  // 2 MiB pages where the host has a pool of them (vm.nr_hugepages), else 4 KiB pages: fewer
  // TLB misses make copies into the window faster (see native/TUNING.md, "Window memory
  // pages"). Hosts with shmem_enabled=advise take the hint.
  Memfd m;
  if (size >= kHugePage) {
    MemfdOptions huge = o;
    huge.flags = MFD_HUGETLB;
    m = try_create_memfd("comm-window-memory", (size + kHugePage - 1) / kHugePage * kHugePage, huge, nullptr);
  }
  // At least one byte: an empty window is still a mapping peers can check.
  if (m.fd < 0)
    m = create_memfd("comm-window-memory", std::max<size_t>(size, 1), o,
                     "allocating " + std::to_string(size) + " bytes of shared memory for a window");
  if (m.bytes >= kHugePage) (void)madvise(m.base, m.bytes, MADV_HUGEPAGE);
  s->fd_ = m.fd;
  s->base_ = m.base;  // fresh pages are zero
  s->mapped_ = m.bytes;
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
    // At least the announced size (mapped whole: a huge-page file is whole pages long).
    PeerMemfd seg{p, peers[p].pid, fds[p], "window memory", std::max<size_t>(peers[p].size, 1)};
    seg.exact = false;
    seg.mismatch = ErrorCode::INVALID_ARGUMENT;
    const Memfd m = map_peer_memfd(seg);
    bases_[p] = m.base;
    lens_[p] = m.bytes;
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
