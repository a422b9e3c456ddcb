// What the files of the Python binding (module comm._native) share.
#pragma once

#include <nanobind/nanobind.h>

#include <memory>

#include "core/op.h"

namespace comm::binding {

namespace nb = nanobind;

// An interned str, for attribute and method names looked up on hot paths.
PyObject* intern(const char* name);
// obj.name; raises (nb::python_error) as Python would.
nb::object attr(PyObject* obj, PyObject* name);

// The Python exception for an engine error: _native.NativeError(code, peer, message), or for
// INTERRUPTED the exception a signal handler raised while the engine waited (KeyboardInterrupt).
nb::object engine_exception(const CommError& e);

// Set Python's error indicator to `exc` (an exception instance); raise() also throws it on.
void set_error(nb::handle exc);
[[noreturn]] void raise(nb::handle exc);

// comm.Work's fast form for the engine's lean path (work.cc): a posted op, the communicator
// that posted it, its name and the arrays it reads and writes (held until it ends).
nb::object make_work(std::shared_ptr<Op> op, nb::handle comm, nb::handle label, nb::handle x, nb::handle out);
void bind_work(nb::module_& m);

// (address, bytes) of a plain array - exactly numpy.ndarray or a CPU torch.Tensor, C-contiguous,
// of a dtype the engine knows, writable when asked - else false with no Python error set.
bool plain_bytes(PyObject* obj, bool writable, uintptr_t* ptr, uint64_t* bytes);
// The one-sided windows (binding_window.cc).
void bind_window(nb::module_& m);

}  // namespace comm::binding
