// Engine errors as Python sees them: the comm.core.errors classes, raised here from the one
// table transports/native hands over at import (set_errors), located at the rank and
// operation where the binding knows them; and the engine's request object, whose wait raises
// them. No other exception type of the engine reaches Python.
#include <array>

#include "binding/binding.h"

namespace comm::binding {
namespace {

// By ErrorCode; null until set_errors (a caller of comm._native alone then gets RuntimeError).
std::array<PyObject*, static_cast<size_t>(ErrorCode::REVOKED) + 1> g_classes{};
PyObject *g_rank = nullptr, *g_op = nullptr, *g_peer = nullptr;

// Python runs signal handlers only on its main thread, between bytecodes: a thread blocked in
// the engine (GIL released) would see Ctrl-C only when the operation ends. The engine asks
// this hook every slice of a long wait; on the main thread it runs the handlers and keeps
// the exception they raised (KeyboardInterrupt) for engine_exception to raise instead of
// the engine's INTERRUPTED error.
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

const char* op_name(const Request& r) {
  if (r.label.is_valid() && PyUnicode_Check(r.label.ptr())) return PyUnicode_AsUTF8(r.label.ptr());
  return kind_name(r.op->args.kind);
}

void request_wait(Request& r, nb::handle timeout) {
  const double t = timeout.is_none() ? -1.0 : nb::cast<double>(timeout);
  try {
    nb::gil_scoped_release unlocked;
    r.op->wait(t);
  } catch (const CommError& e) {
    raise_engine(e, r.rank, op_name(r));
  }
}

}  // namespace

PyObject* error_class(ErrorCode code) {
  const auto i = static_cast<size_t>(code);
  PyObject* cls = i < g_classes.size() ? g_classes[i] : nullptr;
  if (!cls) cls = g_classes[static_cast<size_t>(ErrorCode::SYSTEM)];
  return cls ? cls : PyExc_RuntimeError;
}

nb::object engine_exception(const CommError& e, int rank, const char* op) {
  if (e.code == ErrorCode::INTERRUPTED && raised_type) {  // the handler's own exception
    PyErr_NormalizeException(&raised_type, &raised_value, &raised_tb);
    if (raised_tb) PyException_SetTraceback(raised_value, raised_tb);
    nb::object exc = nb::steal(raised_value);
    Py_XDECREF(raised_type);
    Py_XDECREF(raised_tb);
    raised_type = raised_value = raised_tb = nullptr;
    return exc;
  }
  PyObject* cls = error_class(e.code);
  nb::object args = nb::make_tuple(nb::str(e.msg.data(), e.msg.size()));
  nb::dict where;
  if (cls != PyExc_RuntimeError) {
    where[nb::handle(g_rank)] = rank >= 0 ? nb::object(nb::int_(rank)) : nb::none();
    where[nb::handle(g_op)] = op ? nb::object(nb::str(op)) : nb::none();
    if (e.code == ErrorCode::PEER_FAILURE)
      where[nb::handle(g_peer)] = e.peer >= 0 ? nb::object(nb::int_(e.peer)) : nb::none();
  }
  PyObject* exc = PyObject_Call(cls, args.ptr(), where.ptr());
  if (!exc) throw nb::python_error();
  return nb::steal(exc);
}

void raise(nb::handle exc) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw nb::python_error();
}

void raise_engine(const CommError& e, int rank, const char* op) { raise(engine_exception(e, rank, op)); }

nb::object make_request(std::shared_ptr<Op> op, int rank, nb::handle label) {
  return nb::cast(Request{std::move(op), rank, nb::borrow(label)});
}

void bind_errors(nb::module_& m) {
  g_rank = intern("rank"), g_op = intern("op"), g_peer = intern("peer");
  // An engine error that a call does not locate itself (set-up, windows): rank and op
  // unknown here, filled in by transports/native (CommError.locate).
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CommError& e) {
      nb::object exc = engine_exception(e, -1, nullptr);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
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
  m.attr("ERR_REVOKED") = static_cast<int>(ErrorCode::REVOKED);
  m.def(
      "set_errors",
      [](const nb::dict& classes) {
        for (auto [code, cls] : classes) {
          const auto i = nb::cast<size_t>(code);
          if (i >= g_classes.size() || !PyType_Check(cls.ptr())) throw nb::value_error("an error code or class is unknown");
          Py_XDECREF(g_classes[i]);
          g_classes[i] = nb::borrow(cls).release().ptr();
        }
      },
      nb::arg("classes"),
      "Hand over the exception class of each ERR_* code (ERR_SYSTEM's: any code not given); every\n"
      "engine error is then raised as one, with rank and op set where the call knows them.");
  main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  signal_check = python_signal_raised;

  nb::class_<Request>(m, "Request", "A posted operation of the engine (comm.core.ops.Request).")
      .def("wait", &request_wait, nb::arg("timeout").none() = nb::none(),
           "Wait for completion (None: no limit); raises the operation's CommError.")
      .def("test", [](const Request& r) { return r.op->test(); })  // one atomic load: no GIL release
      .def_prop_ro(
          "source", [](const Request& r) { return r.op->source; },
          "A completed receive's sender (its rank in the group); -1 for other ops.");
}

}  // namespace comm::binding
