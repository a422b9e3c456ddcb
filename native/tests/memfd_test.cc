// The memfd helpers (native/src/channels/shm/memfd.h) every shared segment of the engine goes through:
// creation (mode, close-on-exec, reserved pages, zeroed), a peer's mapping through
// /proc/<pid>/fd from another process, and the errors: a peer that exited, a file of the wrong
// size (exact and at-least checks), each naming the rank, the path and the cause. Built (linking
// the engine library) and run by tests/test_native_engine.py; exits non-zero naming the first
// failed check.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "check.h"
#include "channels/shm/memfd.h"

using namespace comm;

// The error a call throws (code -1: none), with its message.
template <class F>
CommError error_of(F f) {
  try {
    f();
  } catch (const CommError& e) {
    return e;
  }
  return CommError(static_cast<ErrorCode>(-1), -1, "");
}

static bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

static int open_fds() {
  int n = 0;
  for (int fd = 0; fd < 1024; fd++) n += fcntl(fd, F_GETFD) != -1;
  return n;
}

static void creation() {
  MemfdOptions o;
  o.reserve = true;
  Memfd m = create_memfd("comm-test", 3 * 4096, o, "allocating the test segment");
  CHECK(m.fd >= 0 && m.base && m.bytes == 3 * 4096);
  struct stat st {};
  CHECK(fstat(m.fd, &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(st.st_size == 3 * 4096);
  CHECK(static_cast<size_t>(st.st_blocks) * 512 >= 3 * 4096);  // reserved: allocated before any touch
  CHECK(fcntl(m.fd, F_GETFD) & FD_CLOEXEC);
  char link[256] = {};
  const std::string self = "/proc/self/fd/" + std::to_string(m.fd);
  CHECK(readlink(self.c_str(), link, sizeof link - 1) > 0);
  CHECK(has(link, "/memfd:comm-test"));  // anonymous: nothing in /dev/shm
  for (size_t i = 0; i < m.bytes; i++) CHECK(m.base[i] == 0);
  release_memfd(m);
  CHECK(m.fd == -1 && m.base == nullptr);
  release_memfd(m);  // idempotent

  Memfd lazy = create_memfd("comm-test", 64 << 10, MemfdOptions{}, "lazy");
  CHECK(fstat(lazy.fd, &st) == 0 && st.st_blocks == 0);  // not reserved: faults in as used
  release_memfd(lazy);

  MemfdOptions populated;
  populated.populate = true;
  Memfd filled = create_memfd("comm-test", 64 << 10, populated, "populated");
  CHECK(fstat(filled.fd, &st) == 0 && static_cast<size_t>(st.st_blocks) * 512 >= (64 << 10));
  release_memfd(filled);

  // A failed step says which call failed and why, after the caller's words.
  const char* failed = nullptr;
  Memfd none = try_create_memfd("comm-test", 4096, MemfdOptions{~0u & ~MFD_CLOEXEC, false, false}, &failed);
  CHECK(none.fd == -1 && none.base == nullptr && failed && std::string(failed) == "memfd_create");
  const CommError e = error_of([] { create_memfd("comm-test", 4096, MemfdOptions{~0u & ~MFD_CLOEXEC, false, false}, "allocating X"); });
  CHECK(e.code == ErrorCode::SYSTEM);
  CHECK(has(e.msg, "allocating X: memfd_create: ") && has(e.msg, std::strerror(EINVAL)));

  // A step after memfd_create fails (a sparse 4 EiB file maps nowhere): the descriptor is
  // closed again.
  const int fds = open_fds();
  const CommError big = error_of([] { create_memfd("comm-test", size_t{1} << 62, MemfdOptions{}, "allocating Y"); });
  CHECK(big.code == ErrorCode::SYSTEM && has(big.msg, "allocating Y: mmap: " + std::string(std::strerror(ENOMEM))));
  CHECK(open_fds() == fds);

  // Huge pages: a whole page where the host has a pool of them; else a failure that names
  // its call (fallocate, or mmap) and leaves nothing open, so the caller falls back.
  MemfdOptions huge;
  huge.flags = MFD_HUGETLB;
  huge.reserve = true;
  failed = nullptr;
  Memfd h = try_create_memfd("comm-test", 2 << 20, huge, &failed);
  if (h.fd >= 0) {
    CHECK(h.bytes == (2 << 20) && h.base[0] == 0);
    release_memfd(h);
  } else {
    CHECK(failed != nullptr && h.base == nullptr);
  }
  CHECK(open_fds() == fds);
}

// A child process maps the parent's segment, as a local peer does: both see each other's bytes.
static void peer_mapping() {
  MemfdOptions o;
  o.reserve = true;
  Memfd own = create_memfd("comm-test", 8192, o, "own");
  std::strcpy(own.base, "from the owner");
  const int owner = getpid();
  const pid_t child = fork();
  CHECK(child >= 0);
  if (child == 0) {
    PeerMemfd peer{3, owner, own.fd, "test segment", 8192};
    Memfd m = map_peer_memfd(peer);
    const bool ok = m.fd == -1 && m.bytes == 8192 && std::strcmp(m.base, "from the owner") == 0;
    std::strcpy(m.base + 4096, "from the peer");
    release_memfd(m);
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(std::strcmp(own.base + 4096, "from the peer") == 0);

  // Exact: a size other than the announced one is refused, naming the rank, path and sizes.
  PeerMemfd wrong{3, owner, own.fd, "test segment", 4096};
  wrong.mismatch = ErrorCode::INVALID_ARGUMENT;
  wrong.mismatch_hint = " (the likely cause)";
  CommError e = error_of([&] { map_peer_memfd(wrong); });
  const std::string path = "/proc/" + std::to_string(owner) + "/fd/" + std::to_string(own.fd);
  CHECK(e.code == ErrorCode::INVALID_ARGUMENT && e.peer == 3);
  CHECK(has(e.msg, path + " is not rank 3's test segment of 4096 bytes (it has 8192) (the likely cause)"));
  // At least: a larger file is mapped whole; a smaller one is refused (SYSTEM by default).
  wrong.exact = false;
  Memfd whole = map_peer_memfd(wrong);
  CHECK(whole.bytes == 8192 && std::strcmp(whole.base, "from the owner") == 0);
  release_memfd(whole);
  PeerMemfd larger{3, owner, own.fd, "test segment", 8193};
  larger.exact = false;
  e = error_of([&] { map_peer_memfd(larger); });
  CHECK(e.code == ErrorCode::SYSTEM && e.peer == 3 && has(e.msg, "of 8193 bytes (it has 8192)"));
  release_memfd(own);

  // A peer that exited: its /proc entry is gone.
  const pid_t gone = fork();
  CHECK(gone >= 0);
  if (gone == 0) _exit(0);
  CHECK(waitpid(gone, &status, 0) == gone);
  e = error_of([&] { map_peer_memfd(PeerMemfd{5, gone, 3, "test segment", 4096}); });
  CHECK(e.code == ErrorCode::SYSTEM);
  CHECK(has(e.msg, "cannot open the test segment of rank 5 (/proc/" + std::to_string(gone) + "/fd/3; the rank exited"));
  CHECK(has(e.msg, std::strerror(ENOENT)));
}

int main() {
  creation();
  peer_mapping();
  std::printf("all checks passed\n");
  return 0;
}
