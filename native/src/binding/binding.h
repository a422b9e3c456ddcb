// What the files of the Python binding (module comm._native) share.
#pragma once

#include <nanobind/nanobind.h>

#include <atomic>
#include <memory>

#include "core/op.h"

namespace comm {
class Engine;
}

namespace comm::binding {

namespace nb = nanobind;

// An interned str, for attribute and method names looked up on hot paths.
PyObject* intern(const char* name);
// obj.name; raises (nb::python_error) as Python would.
nb::object attr(PyObject* obj, PyObject* name);
// obj.name(); raises as Python would.
nb::object call(PyObject* obj, PyObject* name);

// ---- errors (errors.cc) --------------------------------------------------------------------
// The comm.core.errors exception for an engine error, from the table transports/native hands
// over once (set_errors), located at `rank` (-1: unknown) and `op` (null: unknown); for
// INTERRUPTED, the exception a signal handler raised while the engine waited (KeyboardInterrupt).
nb::object engine_exception(const CommError& e, int rank, const char* op);
// Raise it (as a Python error: nb::python_error).
[[noreturn]] void raise_engine(const CommError& e, int rank, const char* op);
[[noreturn]] void raise(nb::handle exc);
// The table's class for an error code (InvalidArgument for the binding's own refusals).
PyObject* error_class(ErrorCode code);

// The engine's request for a posted operation (comm.core.ops.Request): wait(timeout) raises
// the operation's CommError, located at this rank and named `label` (unset: the kind's name).
// The caller holds the buffers until it ends.
struct Request {
  std::shared_ptr<Op> op;
  int rank;
  nb::object label;
};
nb::object make_request(std::shared_ptr<Op> op, int rank, nb::handle label = nb::handle());
// The error table's setter, the error codes, the signal hook and the Request class.
void bind_errors(nb::module_& m);

// ---- the lean path (lean.cc) ---------------------------------------------------------------
// The communicator's one-collective-at-a-time lock: a BusyLock, which the lean and
// persistent calls take with one atomic exchange (a threading.Lock's acquire through Python
// costs a method call, argument parsing and a clock read per call); any other lock object
// is taken through its Python methods.
struct BusyLock {
  std::atomic<bool> held{false};
  bool try_acquire() { return !held.exchange(true, std::memory_order_acquire); }
  bool acquire(bool blocking);  // Python's Lock.acquire(blocking)
  void release();
};

// Held for the whole of a lean or persistent call, taken without blocking. Taking it here
// rather than in Python saves a Python frame per call: small-message latency is mostly
// Python's per-call cost.
class Busy {
 public:
  explicit Busy(nb::handle lock);
  ~Busy();
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;
  bool held() const { return held_; }

 private:
  PyObject* lock_;
  BusyLock* native_ = nullptr;
  bool held_ = false;
};

// Why run_array / post_array did nothing: the arguments are not the plain case (the caller
// takes the full path), or another thread holds the communicator (the caller raises its
// overlap error).
enum Lean { LEAN_SKIPPED = 0, LEAN_BUSY = 2 };
nb::object run_array(Engine& e, nb::handle busy, int kind, nb::handle x, nb::handle out, nb::handle op,
                     nb::handle root, nb::handle counts, double timeout_s);
nb::object post_array(Engine& e, nb::handle busy, int kind, nb::handle x, nb::handle out, nb::handle op,
                      nb::handle root, nb::handle counts, nb::handle label);
// The BusyLock class and the LEAN_* codes.
void bind_lean(nb::module_& m);

// (address, bytes) of a plain array - exactly numpy.ndarray or a CPU torch.Tensor, C-contiguous,
// of a dtype the engine knows, writable when asked - else false with no Python error set.
bool plain_bytes(PyObject* obj, bool writable, uintptr_t* ptr, uint64_t* bytes);
// A buffer-protocol view, released on scope exit; ok is false (and no Python error is set)
// when the object refuses the request (e.g. writable asked of a read-only array).
struct View {
  Py_buffer v;
  bool ok;
  View(PyObject* obj, bool writable) {
    ok = PyObject_GetBuffer(obj, &v, PyBUF_FORMAT | PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) == 0;
    if (!ok) PyErr_Clear();
  }
  ~View() {
    if (ok) PyBuffer_Release(&v);
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  bool contiguous() const { return PyBuffer_IsContiguous(&v, 'C') != 0; }
};

// The one-sided windows (binding_window.cc).
void bind_window(nb::module_& m);

}  // namespace comm::binding
