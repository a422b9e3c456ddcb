// comm.Work's fast form: the handle of an operation posted by the engine's lean path
// (all_reduce / broadcast of one plain array with async_op=True). comm/work.py's Work does the
// same for every other path; this one is native because on small messages a Python handle
// (its construction, wait, finish and finalizer) cost more than the operation itself.
//
// Behaviour matches comm/work.py line by line; what needs the communicator (its poisoning on
// failure, the abort on Ctrl-C, the refusal in a forked child, the list of dropped handles
// whose buffers must outlive their operations) calls the communicator's own methods, so there
// is one implementation of each.
#include <nanobind/stl/shared_ptr.h>

#include "binding/binding.h"
#include "core/engine.h"

namespace comm::binding {
namespace {

struct Names {
  PyObject *timeout, *refuse, *interrupted, *work_failed, *orphans, *append, *wait_str;
};
Names g{};

class Work {
 public:
  Work(std::shared_ptr<Op> op, nb::handle comm, nb::handle label, nb::handle x, nb::handle out)
      : op_(std::move(op)), comm_(nb::borrow(comm)), label_(nb::borrow(label)), x_(nb::borrow(x)),
        out_(nb::borrow(out)) {}
  ~Work() { orphan(); }
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  bool wait(nb::handle timeout) {
    if (!done_) {
      refuse_if_foreign();
      const double t = nb::cast<double>(timeout.is_none() ? attr(comm_.ptr(), g.timeout) : nb::borrow(timeout));
      try {
        nb::gil_scoped_release unlocked;
        op_->wait(t);
      } catch (const CommError& e) {
        failed(e, /*waited=*/true);
      }
      if (!done_) finish(nb::none());
    }
    if (!error_.is_none()) raise(error_);
    return true;
  }

  bool is_completed() {
    if (!done_) {
      refuse_if_foreign();
      if (!op_->test()) return false;
      try {
        op_->rethrow();
      } catch (const CommError& e) {
        failed(e, /*waited=*/false);
      }
      if (!done_) finish(nb::none());
    }
    return true;
  }

  nb::object exception() {
    is_completed();
    return error_;
  }

  void add_done_callback(nb::handle fn) {
    // The GIL orders this against finish(): neither releases it.
    if (!done_) {
      if (!callbacks_.is_valid()) callbacks_ = nb::list();
      nb::borrow<nb::list>(callbacks_).append(fn);
      return;
    }
    fn(self());
  }

  int source() const { return op_->source; }
  std::shared_ptr<Op> req() const { return op_; }

  // Dropped (or collected) while the operation may still write the buffers: the communicator
  // holds them, with the engine's request, until it sees the operation end (as comm/work.py's
  // __del__). Never throws: it runs in a destructor.
  void orphan() noexcept {
    if (done_ || !comm_.is_valid() || !x_.is_valid()) return;
    // An exception may be on its way out through the frame that dropped this Work (Ctrl-C in
    // wait): kept aside while the communicator is called, as Python does around __del__.
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    try {
      nb::object entry = nb::make_tuple(nb::cast(op_), label_, nb::make_tuple(x_, out_), nb::none());
      PyObject* r = PyObject_CallMethodOneArg(attr(comm_.ptr(), g.orphans).ptr(), g.append, entry.ptr());
      if (!r) throw nb::python_error();
      Py_DECREF(r);
    } catch (nb::python_error& e) {
      e.discard_as_unraisable(comm_);
    } catch (const std::exception&) {
    }
    PyErr_Restore(type, value, tb);
    x_ = out_ = nb::object();
  }

  // Cyclic garbage collection: an error's traceback can reach the frame that holds this Work.
  int traverse(visitproc visit, void* arg) {
    Py_VISIT(comm_.ptr());
    Py_VISIT(label_.ptr());
    Py_VISIT(x_.ptr());
    Py_VISIT(out_.ptr());
    Py_VISIT(error_.ptr());
    Py_VISIT(callbacks_.ptr());
    return 0;
  }
  void clear() {
    orphan();  // before the buffers go: the operation may still write them
    comm_ = label_ = x_ = out_ = callbacks_ = nb::object();
    error_ = nb::none();
  }

 private:
  nb::object self() { return nb::find(this); }

  void refuse_if_foreign() {
    if (!comm_.is_valid()) return;
    // The engine is told of a fork when the communicator is (Communicator._disown): its flag
    // is one load where the communicator's attribute is a lookup. (A lean op is a queued
    // collective: its engine is always set.)
    if (op_->engine->forked()) {
      PyObject* r = PyObject_CallMethodOneArg(comm_.ptr(), g.refuse, g.wait_str);  // raises
      Py_XDECREF(r);
      throw nb::python_error();
    }
  }

  // The operation ended with (or its wait raised) the engine's error e.
  void failed(const CommError& e, bool waited) {
    nb::object exc = engine_exception(e);
    if (waited && !PyObject_IsInstance(exc.ptr(), PyExc_Exception)) {
      // a signal handler's exception (Ctrl-C) while waiting: the communicator aborts, and the
      // operation stays unfinished, as in comm/work.py
      PyObject* r = PyObject_CallMethodObjArgs(comm_.ptr(), g.interrupted, exc.ptr(), Py_None, nullptr);
      if (!r) throw nb::python_error();
      Py_DECREF(r);
      raise(exc);
    }
    PyObject* r = PyObject_CallMethodObjArgs(comm_.ptr(), g.work_failed, label_.ptr(), exc.ptr(), Py_None, nullptr);
    if (!r) throw nb::python_error();
    finish(nb::steal(r));
  }

  void finish(nb::object error) {
    error_ = std::move(error);
    done_ = true;
    x_ = out_ = nb::object();  // release the buffers
    if (!callbacks_.is_valid()) return;
    nb::object callbacks = std::move(callbacks_);
    nb::object me = self();
    for (nb::handle fn : callbacks) fn(me);
  }

  std::shared_ptr<Op> op_;
  nb::object comm_, label_, x_, out_;
  nb::object error_ = nb::none();
  nb::object callbacks_;  // a list once a callback is added
  bool done_ = false;
};

int work_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  return nb::inst_ptr<Work>(self)->traverse(visit, arg);
}

int work_clear(PyObject* self) {
  if (nb::inst_ready(self)) nb::inst_ptr<Work>(self)->clear();
  return 0;
}

PyType_Slot work_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(work_traverse)},
                            {Py_tp_clear, reinterpret_cast<void*>(work_clear)},
                            {0, nullptr}};

}  // namespace

nb::object make_work(std::shared_ptr<Op> op, nb::handle comm, nb::handle label, nb::handle x, nb::handle out) {
  return nb::cast(new Work(std::move(op), comm, label, x, out), nb::rv_policy::take_ownership);
}

void bind_work(nb::module_& m) {
  g = Names{intern("timeout"), intern("_refuse"), intern("_interrupted"),
            intern("_work_failed"), intern("_orphans"), intern("append"), intern("wait")};
  nb::class_<Work>(m, "LeanWork", nb::type_slots(work_slots),
                   "comm.Work of the engine's lean path (see comm/work.py for the methods).")
      .def("wait", &Work::wait, nb::arg("timeout") = nb::none())
      .def("is_completed", &Work::is_completed)
      .def("exception", &Work::exception)
      .def("add_done_callback", &Work::add_done_callback, nb::arg("fn"))
      .def_prop_ro("source", &Work::source)
      .def_prop_ro("_req", &Work::req);
}

}  // namespace comm::binding
