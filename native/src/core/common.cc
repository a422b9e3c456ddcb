#include "core/common.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace comm {

size_t itemsize(DType t) {
  static const size_t sizes[] = {2, 2, 4, 8, 1, 2, 4, 8, 1, 1};
  return sizes[static_cast<int>(t)];
}

bool is_floating(DType t) { return t <= DType::F64; }

const char* kind_name(OpKind k) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                "reduce", "gather", "scatter", "all_to_all", "send", "recv",
                                "barrier", "all_gather_v", "reduce_scatter_v"};
  return names[static_cast<int>(k)];
}

void fail(ErrorCode code, int peer, std::string msg) { throw CommError(code, peer, std::move(msg)); }

void fail_errno(const std::string& what) {
  fail(ErrorCode::SYSTEM, -1, what + ": " + std::strerror(errno));
}

namespace {

// Moves `bytes` between `local` and `addr` of process `pid` with `call` (process_vm_readv or
// process_vm_writev), retrying interrupted and partial transfers.
template <class Call>
bool whole(int pid, uint64_t addr, char* local, size_t bytes, Call call) {
  while (bytes > 0) {
    iovec here{local, bytes};
    iovec there{reinterpret_cast<void*>(addr), bytes};
    const ssize_t n = call(static_cast<pid_t>(pid), &here, 1, &there, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = 0;
      return false;
    }
    local += n;
    addr += static_cast<uint64_t>(n);
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

bool read_process(int pid, uint64_t addr, void* dst, size_t bytes) {
  return whole(pid, addr, static_cast<char*>(dst), bytes, process_vm_readv);
}

bool write_process(int pid, uint64_t addr, const char* src, size_t bytes) {
  return whole(pid, addr, const_cast<char*>(src), bytes, process_vm_writev);
}

void fail_unreadable(int peer) {
  fail(ErrorCode::PEER_FAILURE, peer,
       "cannot read the buffer of rank " + std::to_string(peer) + " (process_vm_readv: " +
           (errno ? std::strerror(errno) : "nothing read") + ")");
}

SignalCheck signal_check = nullptr;

void check_signals() {
  if (signal_check && signal_check())
    fail(ErrorCode::INTERRUPTED, -1, "interrupted by a signal while waiting");
}

int Deadline::ms_left(int cap_ms) const {
  if (at == Clock::time_point::max()) return cap_ms;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, cap_ms));
}

}  // namespace comm
