// The Python face of the engine (module comm._native). Every call releases the GIL; engine
// errors become _native.NativeError(code, peer, message), which transports/native.py maps
// onto the comm.errors classes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "engine.h"
#include "reduce.h"

namespace nb = nanobind;
using namespace comm;

namespace {
// Python runs signal handlers only on its main thread, between bytecodes: a thread blocked in
// the engine (GIL released) would see Ctrl-C only when the operation ends. The engine asks
// this hook every slice of a long wait; on the main thread it runs the handlers and keeps
// the exception they raised (KeyboardInterrupt) for the translator below to raise instead
// of the engine's INTERRUPTED error.
unsigned long main_thread = 0;
thread_local PyObject *raised_type = nullptr, *raised_value = nullptr, *raised_tb = nullptr;

bool python_signal_raised() {
  if (PyThread_get_thread_ident() != main_thread) return false;
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  Py_XDECREF(raised_type);
  Py_XDECREF(raised_value);
  Py_XDECREF(raised_tb);
  PyErr_Fetch(&raised_type, &raised_value, &raised_tb);
  return true;
}
}  // namespace

NB_MODULE(_native, m) {
  static PyObject* native_error =
      PyErr_NewException("comm._native.NativeError", PyExc_RuntimeError, nullptr);
  m.attr("NativeError") = nb::handle(native_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CommError& e) {
      if (e.code == ErrorCode::INTERRUPTED && raised_type) {
        PyErr_Restore(raised_type, raised_value, raised_tb);  // the handler's own exception
        raised_type = raised_value = raised_tb = nullptr;
        return;
      }
      nb::object args = nb::make_tuple(static_cast<int>(e.code), e.peer, e.msg);
      PyErr_SetObject(native_error, args.ptr());
    }
  });
  m.attr("ERR_TIMEOUT") = static_cast<int>(ErrorCode::TIMEOUT);
  m.attr("ERR_PEER_FAILURE") = static_cast<int>(ErrorCode::PEER_FAILURE);
  m.attr("ERR_ABORTED") = static_cast<int>(ErrorCode::ABORTED);
  m.attr("ERR_MISMATCH") = static_cast<int>(ErrorCode::MISMATCH);
  m.attr("ERR_CLOSED") = static_cast<int>(ErrorCode::CLOSED);
  m.attr("ERR_SYSTEM") = static_cast<int>(ErrorCode::SYSTEM);
  m.attr("ERR_INVALID_ARGUMENT") = static_cast<int>(ErrorCode::INVALID_ARGUMENT);
  m.attr("ERR_INTERRUPTED") = static_cast<int>(ErrorCode::INTERRUPTED);
  main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  signal_check = python_signal_raised;
  m.def("kernel_isa", &kernel_isa, "Instruction set the reduction kernels use on this CPU.");
  // The buffer protocol from C: ~10x cheaper than numpy's __array_interface__ dict, and
  // Python's per-call cost is what bounds small-message latency.
  m.def(
      "buffer_address",
      [](nb::handle obj) -> nb::object {
        Py_buffer view;
        if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_STRIDES) != 0) {
          PyErr_Clear();
          return nb::none();
        }
        const bool contiguous = PyBuffer_IsContiguous(&view, 'C') != 0;
        nb::object info = nb::make_tuple(reinterpret_cast<uintptr_t>(view.buf),
                                         view.readonly != 0, contiguous);
        PyBuffer_Release(&view);
        return info;
      },
      "(address, readonly, C-contiguous) of a buffer-protocol object, or None.");

  using release = nb::call_guard<nb::gil_scoped_release>;

  nb::class_<Op>(m, "Work")
      .def("wait", &Op::wait, nb::arg("timeout_s"), release(),
           "Wait for completion (timeout_s < 0: no limit); raises NativeError.")
      .def("test", &Op::test, release());

  nb::class_<Engine>(m, "Engine")
      .def(
          "__init__",
          [](Engine* self, int rank, int size, std::vector<int> local_ranks, double timeout_s,
             std::string algo, size_t chunk_bytes, size_t direct_max_bytes) {
            new (self) Engine(rank, size, std::move(local_ranks),
                              Options{timeout_s, std::move(algo), chunk_bytes, direct_max_bytes});
          },
          nb::arg("rank"), nb::arg("size"), nb::arg("local_ranks"), nb::arg("timeout_s"),
          nb::arg("algo"), nb::arg("chunk_bytes"), nb::arg("direct_max_bytes"))
      .def("shm_create", &Engine::shm_create, release())
      .def("shm_attach", &Engine::shm_attach, release())
      .def("cma_probe", &Engine::cma_probe, release())
      .def("set_cma", &Engine::set_cma, release())
      .def("add_peer", &Engine::add_peer, nb::arg("peer"), nb::arg("monitor_fd"),
           nb::arg("coll_fds"), nb::arg("p2p_fd"), release(),
           "Hand over connected sockets (the engine owns and closes them).")
      .def("start", &Engine::start, release())
      .def(
          "post",
          [](Engine& e, int kind, int dtype, int op, double scale, uintptr_t send,
             uint64_t send_bytes, uintptr_t recv, uint64_t recv_bytes, uint64_t count, int root,
             int peer, int tag, std::vector<uint64_t> send_counts,
             std::vector<uint64_t> recv_counts, bool blocking) {
            check_codes(kind, dtype, op);  // before the casts: enums hold only known codes
            return e.post(OpArgs{static_cast<OpKind>(kind), static_cast<DType>(dtype),
                                 static_cast<ReduceOp>(op), scale, send, send_bytes, recv,
                                 recv_bytes, count, root, peer, tag, std::move(send_counts),
                                 std::move(recv_counts)},
                          blocking);
          },
          release(),
          "Post one operation (send_bytes / recv_bytes: the sizes of the memory at send / recv, which\n"
          "the engine never reads or writes past); returns a Work, or None when it already ran to\n"
          "completion.")
      .def(
          "forget_after_fork",
          [](nb::handle self) {
            nb::cast<Engine&>(self).forget_after_fork();
            self.inc_ref();  // never destroyed in the child: see Engine::forget_after_fork
            nb::set_leak_warnings(false);  // so the child's exit reports it as no bug
          },
          "In a forked child: drop this process's copies of the connections; leaks the engine.")
      .def("abort", &Engine::abort, release())
      .def("close", &Engine::close, release())
      .def_prop_ro("last_algorithm", &Engine::last_algorithm);
}
