// Shared vocabulary of the engine: element types, operators, op kinds, errors, deadlines.
// The enum values are the wire codes of comm/core/types.py and transports/base.py: never renumber.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

namespace comm {

enum class DType : uint8_t { F16 = 0, BF16, F32, F64, I8, I16, I32, I64, U8, BOOL, COUNT };
enum class ReduceOp : uint8_t { SUM = 0, PRODUCT, MIN, MAX, AVG, BAND, BOR, BXOR, PREMUL_SUM, COUNT };
// What a compressed collective puts on the wire between hosts (compress.h has the formats).
enum class Wire : uint8_t { EXACT = 0, BF16, FP8, COUNT };
enum class OpKind : uint8_t {
  ALL_REDUCE = 0, REDUCE_SCATTER, ALL_GATHER, BROADCAST, REDUCE, GATHER, SCATTER,
  ALL_TO_ALL, SEND, RECV, BARRIER, ALL_GATHER_V, REDUCE_SCATTER_V, COUNT
};
// Send and receive: progressed by the engine's P2P, never through the collective queue.
inline bool is_p2p(OpKind k) { return k == OpKind::SEND || k == OpKind::RECV; }

size_t itemsize(DType t);
bool is_floating(DType t);
const char* kind_name(OpKind k);

// Error codes, each a comm.core.errors class in the table transports/native hands the binding.
enum class ErrorCode : int {
  TIMEOUT = 1, PEER_FAILURE, ABORTED, MISMATCH, CLOSED, SYSTEM,
  INVALID_ARGUMENT,  // the caller's arguments; nothing was sent and the communicator stays usable
  INTERRUPTED,       // a signal handler (Ctrl-C) stopped the wait
  REVOKED            // a rank revoked the communicator (ULFM's revoke): only shrink goes on
};

// The one exception type the engine throws; the binding raises it as a comm.core.errors class.
struct CommError : std::exception {
  ErrorCode code;
  int peer;  // the rank at fault, -1 when unknown
  std::string msg;
  CommError(ErrorCode c, int p, std::string m) : code(c), peer(p), msg(std::move(m)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

[[noreturn]] void fail(ErrorCode code, int peer, std::string msg);
// Throws SYSTEM with strerror(errno) appended.
[[noreturn]] void fail_errno(const std::string& what);

// Copies `bytes` at `addr` of process `pid` into `dst` (process_vm_readv: one copy between
// processes); false, with errno set (0 for a short read), when they cannot all be read.
bool read_process(int pid, uint64_t addr, void* dst, size_t bytes);
// The same towards the process (process_vm_writev): `bytes` from `src` to its `addr`.
bool write_process(int pid, uint64_t addr, const char* src, size_t bytes);
// PEER_FAILURE: the memory of rank `peer` could not be read (errno from read_process).
[[noreturn]] void fail_unreadable(int peer);

using Clock = std::chrono::steady_clock;

// Signals (Ctrl-C) reach a thread blocked in the engine through this hook, which the Python
// binding sets: true when the host's signal handlers ask the calling thread to stop. Long
// waits call check_signals() every kSignalSlice (never on the latency path: the hook may
// have to wait for Python's lock), and it throws INTERRUPTED when the hook says so.
using SignalCheck = bool (*)();
extern SignalCheck signal_check;
constexpr auto kSignalSlice = std::chrono::milliseconds(50);
void check_signals();

// Absolute end of the current operation; every wait in the engine checks it.
struct Deadline {
  Clock::time_point at = Clock::time_point::max();
  bool passed() const { return Clock::now() >= at; }
  // Milliseconds left, clamped to [0, cap_ms].
  int ms_left(int cap_ms) const;
};

}  // namespace comm
