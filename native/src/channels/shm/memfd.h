// Anonymous shared memory between the processes of one host (the shm channel's segments, a
// window's signal counters, an allocated window's memory): one way to create a segment and one
// way to map a local peer's.
//
// A segment is a memfd: no name exists that could outlive the job, whatever way its processes
// end. Peers open it through /proc/<pid>/fd/<fd> of its creator, which keeps the descriptor
// open while peers may still map it; that open already requires the same user (ptrace access
// to the creator), and mode 0600 says so too.
#pragma once

#include <cstddef>
#include <string>

#include "core/common.h"

namespace comm {

// A segment mapped into this process. fd: the creator's descriptor (-1 in a peer's mapping,
// whose descriptor is closed once mapped). bytes: the length mapped, for munmap.
struct Memfd {
  int fd = -1;
  char* base = nullptr;
  size_t bytes = 0;
};

struct MemfdOptions {
  unsigned flags = 0;     // memfd_create flags besides MFD_CLOEXEC (MFD_HUGETLB)
  // Allocate every page now (fallocate), so a host short of memory fails at creation, clearly,
  // rather than with SIGBUS in whichever process first touches a page that cannot be had. A
  // file system without fallocate (EOPNOTSUPP) faults in as used.
  bool reserve = false;
  // Page tables filled in now, writable (MAP_POPULATE, MADV_POPULATE_WRITE): no fault at a
  // page's first use, by the creator or by a peer (a read-only fill would fault at the first write).
  bool populate = false;
};

// Creates a segment of `bytes` (close-on-exec, mode 0600) and maps it read-write; fresh
// pages are zero. Throws SYSTEM "<what>: <the call that failed>: <errno text>", closing
// what it opened.
Memfd create_memfd(const char* name, size_t bytes, const MemfdOptions& o, const std::string& what);
// The same, without throwing (a caller with a fallback: huge pages): fd -1 and errno set,
// and *failed names the call that failed.
Memfd try_create_memfd(const char* name, size_t bytes, const MemfdOptions& o, const char** failed);

// A local peer's segment, as the peer announced it.
struct PeerMemfd {
  int rank;               // the owner (messages)
  int pid, fd;            // its process and its descriptor there
  const char* what;       // "shared memory", "window signals", ...: messages say "rank R's <what>"
  size_t bytes;           // the size the peer announced
  // true: the file must be exactly `bytes` long (both sides compute a layout from it); false:
  // at least `bytes` (a write past a file's end is a SIGBUS), mapped whole (a huge-page
  // file is whole pages long, as mmap and munmap want there).
  bool exact = true;
  bool populate = false;  // as MemfdOptions::populate
  // The code of "that file is not the segment" (its size differs): SYSTEM where only a bug
  // or a reused descriptor can cause it, INVALID_ARGUMENT where the ranks' arguments differ.
  ErrorCode mismatch = ErrorCode::SYSTEM;
  const char* mismatch_hint = "";  // appended to that message: the likely cause
};

// Opens and maps `peer`'s segment read-write (fd -1 in the result). Throws SYSTEM (with the
// errno text) when it cannot be opened or mapped, `peer.mismatch` when its size is wrong.
Memfd map_peer_memfd(const PeerMemfd& peer);

// Unmaps and closes (either may be absent); idempotent: `m` is left empty.
void release_memfd(Memfd& m);

}  // namespace comm
