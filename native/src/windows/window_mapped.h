// Library-allocated windows (Communicator.window(nbytes), as MPI_Win_allocate / nvshmem_malloc):
// the window's memory is a memfd segment that every peer on this host maps, so a put or get
// to such a peer is a memcpy into or out of the mapping (and its flush a fence), with no
// system call and no engine thread in between.
//
// The segment is anonymous (as ShmDomain's): nothing named outlives the job. Peers open it
// through /proc/<pid>/fd/<fd> of the owner (same user, as the shm channel already requires).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace comm {

class Comm;
struct WindowPeer;

// This rank's allocated window memory. Shared (shared_ptr) between the Window and every numpy
// array over it, so the memory outlives close() while the application still holds an array
// (peers have unmapped it by then: nobody writes into it any more).
class WindowSegment {
 public:
  static std::shared_ptr<WindowSegment> allocate(uint64_t size);
  ~WindowSegment();
  WindowSegment(const WindowSegment&) = delete;
  WindowSegment& operator=(const WindowSegment&) = delete;

  char* base() const { return base_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }

 private:
  WindowSegment() = default;
  char* base_ = nullptr;
  uint64_t size_ = 0;
  size_t mapped_ = 0;  // at least one byte: an empty window is still a mapping peers can check
  int fd_ = -1;
};

// The local peers' allocated windows, mapped into this process (one per peer at most).
class PeerMappings {
 public:
  PeerMappings() = default;
  ~PeerMappings() { unmap(); }
  PeerMappings(const PeerMappings&) = delete;
  PeerMappings& operator=(const PeerMappings&) = delete;

  // Maps the segment of every peer p on this host (other than this rank) with fds[p] >= 0;
  // fds empty: none. Fails (CommError) when a segment cannot be opened or is smaller than
  // the size the peer announced.
  void map(const Comm& c, const std::vector<WindowPeer>& peers, const std::vector<int>& fds);
  // Where peer's window starts here, or nullptr: not mapped (another host, or user memory).
  char* base(int peer) const { return peer < static_cast<int>(bases_.size()) ? bases_[peer] : nullptr; }
  bool any() const { return any_; }
  // No more writes through any mapping (close); idempotent.
  void unmap();

 private:
  std::vector<char*> bases_;
  std::vector<size_t> lens_;
  bool any_ = false;
};

}  // namespace comm
