// The Python face of the engine (module comm._native). Every call releases the GIL; engine
// errors become _native.NativeError(code, peer, message), which transports/native/__init__.py maps
// onto the comm.core.errors classes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>
#include <atomic>

#include <sched.h>

#include "algorithms/algorithms.h"
#include "binding/binding.h"
#include "kernels/compress.h"
#include "core/engine.h"
#include "kernels/reduce.h"

namespace nb = nanobind;
using namespace comm;
using binding::attr;
using binding::intern;

namespace {

using release = nb::call_guard<nb::gil_scoped_release>;

// Which reductions each dtype allows: comm.core.types.op_allowed's table, handed over once by
// transports/native/__init__.py (one source of truth).
std::array<std::array<bool, static_cast<size_t>(DType::COUNT)>, static_cast<size_t>(ReduceOp::COUNT)>
    g_reducible{};
PyObject* g_ndarray = nullptr;         // numpy.ndarray: the one type the lean path reads
PyObject* g_buffer_changed = nullptr;  // _native.BufferChanged

// Attribute and method names of the hot calls, interned once at import: a C-string name
// would be turned into a new str object on every access.
struct Names {
  PyObject *is_cpu, *dtype, *is_contiguous, *data_ptr, *nbytes, *storage_offset, *untyped_storage,
      *is_neg, *acquire, *release, *dim, *shape;
};
Names g_names{};

nb::object call(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj, name);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

// The communicator's one-collective-at-a-time lock: a BusyLock, which the lean and
// persistent calls take with one atomic exchange (a threading.Lock's acquire through Python
// costs a method call, argument parsing and a clock read per call); any other lock object
// is taken through its Python methods.
struct BusyLock {
  std::atomic<bool> held{false};
  bool try_acquire() { return !held.exchange(true, std::memory_order_acquire); }
  // Python's Lock.acquire(blocking): a blocking one yields (GIL released) until it is free.
  bool acquire(bool blocking) {
    if (try_acquire()) return true;
    if (!blocking) return false;
    nb::gil_scoped_release unlocked;
    while (!try_acquire()) sched_yield();
    return true;
  }
  void release() {
    if (!held.exchange(false, std::memory_order_release))
      throw std::runtime_error("release unlocked lock");
  }
};
PyTypeObject* g_busy_lock_type = nullptr;

// Held for the whole of a lean or persistent call, taken without blocking, as
// Communicator._post takes it. Taking it here rather than in Python saves a Python frame
// per call: small-message latency is mostly Python's per-call cost.
class Busy {
 public:
  explicit Busy(nb::handle lock) : lock_(lock.ptr()) {
    if (Py_TYPE(lock_) == g_busy_lock_type) {
      native_ = nb::inst_ptr<BusyLock>(lock);
      held_ = native_->try_acquire();
      return;
    }
    PyObject* got = PyObject_CallMethodOneArg(lock_, g_names.acquire, Py_False);
    if (!got) throw nb::python_error();
    held_ = got == Py_True;
    Py_DECREF(got);
  }
  ~Busy() {
    if (!held_) return;
    if (native_) {
      native_->held.store(false, std::memory_order_release);
      return;
    }
    // Never throws: an exception may be on its way out (it is held by nb::python_error,
    // not by the interpreter's error indicator, so this call may run).
    PyObject* r = PyObject_CallMethodNoArgs(lock_, g_names.release);
    if (r) Py_DECREF(r);
    else PyErr_WriteUnraisable(lock_);
  }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;
  bool held() const { return held_; }

 private:
  PyObject* lock_;
  BusyLock* native_ = nullptr;
  bool held_ = false;
};

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

// numpy's format character of each engine dtype (bfloat16 never arrives through numpy).
bool dtype_of(const Py_buffer& v, DType* out) {
  const char* f = v.format ? v.format : "B";
  if (*f == '<' || *f == '=' || *f == '@') f++;
  if (f[0] == 0 || f[1] != 0) return false;
  DType t;
  switch (f[0]) {
    case 'e': t = DType::F16; break;
    case 'f': t = DType::F32; break;
    case 'd': t = DType::F64; break;
    case 'b': t = DType::I8; break;
    case 'h': t = DType::I16; break;
    case 'i': t = DType::I32; break;
    case 'l': case 'q': t = DType::I64; break;
    case 'B': t = DType::U8; break;
    case '?': t = DType::BOOL; break;
    default: return false;
  }
  if (static_cast<size_t>(v.itemsize) != itemsize(t)) return false;
  *out = t;
  return true;
}

// torch, when the program has loaded it (never imported from here): its Tensor type and
// dtype objects in engine dtype order, read through Python attributes.
struct Torch {
  PyObject* tensor = nullptr;
  std::array<PyObject*, static_cast<size_t>(DType::COUNT)> dtypes{};
};
Torch g_torch;

bool torch_loaded() {
  if (g_torch.tensor) return true;
  nb::handle mod(PyImport_GetModule(nb::str("torch").ptr()));  // new reference, or null
  if (!mod.ptr()) {
    PyErr_Clear();
    return false;
  }
  nb::object owned = nb::steal(mod);
  static const char* names[] = {"float16", "bfloat16", "float32", "float64", "int8",
                                "int16", "int32", "int64", "uint8", "bool"};
  Torch t;
  if (!nb::hasattr(owned, "Tensor")) return false;  // still being imported
  for (size_t i = 0; i < t.dtypes.size(); i++) {
    if (!nb::hasattr(owned, names[i])) return false;
    t.dtypes[i] = nb::object(owned.attr(names[i])).release().ptr();
  }
  t.tensor = nb::object(owned.attr("Tensor")).release().ptr();
  g_torch = t;
  return true;
}

// Where a plain array's elements are, and its shape where the caller asked for it.
struct Array {
  uintptr_t ptr;
  uint64_t bytes;
  DType dtype;
  std::vector<uint64_t> shape;
};

// What plain_array requires of an array's dimensions: any, exactly one, or at least one with
// the shape recorded (all_to_all's splits count rows of dim 0).
enum class Dims { ANY, ONE, SHAPE };

// A plain array usable as-is: exactly numpy.ndarray (C-contiguous, a supported dtype,
// writable when it will be written; read through the buffer protocol) or exactly a
// contiguous CPU torch.Tensor. False for anything else, with no Python error set.
bool plain_array(PyObject* obj, bool writable, Array* out, Dims dims = Dims::ANY) {
  if (Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(g_ndarray)) {
    View view(obj, writable);
    if (!view.ok || !view.contiguous() || !dtype_of(view.v, &out->dtype)) return false;
    if (dims == Dims::ONE ? view.v.ndim != 1 : dims == Dims::SHAPE && view.v.ndim < 1) return false;
    out->ptr = reinterpret_cast<uintptr_t>(view.v.buf);
    out->bytes = static_cast<uint64_t>(view.v.len);
    if (dims == Dims::SHAPE) out->shape.assign(view.v.shape, view.v.shape + view.v.ndim);
    return true;  // the caller holds obj for the whole call: the memory stays
  }
  if (!torch_loaded() || Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(g_torch.tensor)) return false;
  try {
    const Names& n = g_names;
    if (attr(obj, n.is_cpu).ptr() != Py_True) return false;
    nb::object dtype = attr(obj, n.dtype);
    size_t i = 0;
    while (i < g_torch.dtypes.size() && g_torch.dtypes[i] != dtype.ptr()) i++;
    if (i == g_torch.dtypes.size() || call(obj, n.is_contiguous).ptr() != Py_True) return false;
    const auto ptr = nb::cast<uintptr_t>(call(obj, n.data_ptr));
    const auto bytes = nb::cast<uint64_t>(attr(obj, n.nbytes));
    // nbytes is numel * itemsize whatever the storage holds: a storage freed or resized to 0
    // (FSDP frees parameters so) or too small, and lazy negation views, take the full path,
    // which refuses them (comm/core/buffers.py).
    if (bytes && !ptr) return false;
    const auto offset = nb::cast<uint64_t>(call(obj, n.storage_offset)) * itemsize(static_cast<DType>(i));
    if (nb::cast<uint64_t>(call(call(obj, n.untyped_storage).ptr(), n.nbytes)) < offset + bytes) return false;
    if (call(obj, n.is_neg).ptr() != Py_False) return false;
    if (dims == Dims::ONE && nb::cast<long>(call(obj, n.dim)) != 1) return false;
    *out = Array{ptr, bytes, static_cast<DType>(i), {}};
    if (dims == Dims::SHAPE) {
      out->shape = nb::cast<std::vector<uint64_t>>(attr(obj, n.shape));
      if (out->shape.empty()) return false;
    }
    return true;
  } catch (const std::exception&) {  // python_error (cleared by its destructor) or a bad cast
    return false;
  }
}

// Post on the caller's thread; an op queued behind async work is waited for here.
void post_and_wait(Engine& e, OpArgs args, double timeout_s) {
  nb::gil_scoped_release unlocked;
  if (auto op = e.post(std::move(args), true)) op->wait(timeout_s);
}

// Why run_array / post_array did nothing: the arguments are not the plain case (the caller
// takes the full path), or another thread holds the communicator (the caller raises its
// overlap error). When they did something they return None or the Work.
enum Lean { LEAN_SKIPPED = 0, LEAN_BUSY = 2 };

// counts of a v-collective: a list or tuple of non-negative Python ints, one per rank; false
// (touching nothing) for anything else.
bool lean_counts(nb::handle counts, int size, std::vector<uint64_t>* out) {
  PyObject* seq = counts.ptr();
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return false;
  if (PySequence_Fast_GET_SIZE(seq) != size) return false;
  PyObject** items = PySequence_Fast_ITEMS(seq);
  out->resize(size);
  for (int i = 0; i < size; i++) {
    if (!PyLong_CheckExact(items[i])) return false;
    const long long k = PyLong_AsLongLong(items[i]);
    if (k < 0) {  // negative, or past 64 bits (an error then)
      PyErr_Clear();
      return false;
    }
    (*out)[i] = static_cast<uint64_t>(k);
  }
  return true;
}

// The sum of `counts` in `total` when it is at most `limit`; false otherwise (no sum can
// overflow: each count and partial sum is checked against the limit as it is added).
bool sum_within(const std::vector<uint64_t>& counts, uint64_t limit, uint64_t* total) {
  *total = 0;
  for (uint64_t k : counts)
    if (k > limit || (*total += k) > limit) return false;
  return true;
}

// all_to_all's splits, in elements, of arrays of these shapes: `counts` None for equal blocks,
// or (out_splits, in_splits), rows of dim 0 as lists or tuples of ints that add up to the
// arrays' rows, this rank's own block alike in both; rows of one shape in both arrays. False
// for anything else (the full path names the problem, or takes the edge cases).
bool lean_splits(const Engine& e, nb::handle counts, const std::vector<uint64_t>& in_shape,
                 const std::vector<uint64_t>& out_shape, std::vector<uint64_t>* sends,
                 std::vector<uint64_t>* expects) {
  const int n = e.size();
  if (in_shape.size() != out_shape.size() || !std::equal(in_shape.begin() + 1, in_shape.end(), out_shape.begin() + 1))
    return false;
  // Elements per row. The product can wrap only for an array of no rows, whose splits are
  // all 0; the engine checks every block against the bytes handed over anyway (validate.cc).
  uint64_t row = 1;
  for (size_t d = 1; d < in_shape.size(); d++) row *= in_shape[d];
  const uint64_t rows_in = in_shape[0], rows_out = out_shape[0];
  if (!row) return false;  // rows of no elements: the full path's edge case
  if (counts.is_none()) {
    if (rows_in != rows_out || rows_in % n) return false;
    sends->assign(n, rows_in / n * row);
    *expects = *sends;
    return true;
  }
  PyObject* pair = counts.ptr();
  if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
      !lean_counts(nb::handle(PyTuple_GET_ITEM(pair, 0)), n, expects) ||
      !lean_counts(nb::handle(PyTuple_GET_ITEM(pair, 1)), n, sends))
    return false;
  uint64_t sent, expected;
  if (!sum_within(*sends, rows_in, &sent) || !sum_within(*expects, rows_out, &expected) || sent != rows_in ||
      expected != rows_out || (*sends)[e.rank()] != (*expects)[e.rank()])
    return false;
  for (auto* splits : {sends, expects})
    for (uint64_t& k : *splits) k *= row;
  return true;
}

// Whether a call's input and output share memory other than in its in-place layout (the
// output itself for all_reduce; this rank's block for the gathers and scatters; none for
// all_to_all): the full path then refuses it, naming the layout (Communicator._apart).
bool overlaps(const OpArgs& a, int rank) {
  if (!a.send_bytes || !a.recv_bytes || a.send + a.send_bytes <= a.recv || a.recv + a.recv_bytes <= a.send)
    return false;
  uint64_t at = 0;  // this rank's block in the v-collectives
  for (int q = 0; q < rank && q < static_cast<int>(a.recv_counts.size()); q++) at += a.recv_counts[q];
  at *= itemsize(a.dtype);
  switch (a.kind) {
    case OpKind::ALL_REDUCE: return a.send != a.recv;
    case OpKind::ALL_GATHER: return a.send != a.recv + rank * a.send_bytes;
    case OpKind::ALL_GATHER_V: return a.send != a.recv + at;
    case OpKind::REDUCE_SCATTER: return a.recv != a.send + rank * a.recv_bytes;
    case OpKind::REDUCE_SCATTER_V: return a.recv != a.send + at;
    default: return true;
  }
}

// The arguments of the lean path's call: all_reduce (in place or into `out`) or broadcast of
// one plain array, all_gather / reduce_scatter between two, all_gather_v / reduce_scatter_v
// between plain 1-D arrays with `counts`, or all_to_all between plain arrays with rows of one
// shape, `counts` None (equal blocks) or (out_splits, in_splits);
// false, having touched nothing, for anything else (the caller then takes the full path,
// whose checks name the problem).
bool lean_args(Engine& e, int kind, nb::handle x, nb::handle out, nb::handle op_obj, nb::handle root_obj,
               nb::handle counts, OpArgs* args) {
  const auto k = static_cast<OpKind>(kind);
  const bool v = k == OpKind::ALL_GATHER_V || k == OpKind::REDUCE_SCATTER_V;
  const bool even = k == OpKind::ALL_GATHER || k == OpKind::REDUCE_SCATTER;  // blocks of one size
  const bool a2a = k == OpKind::ALL_TO_ALL;
  const bool reduces = k == OpKind::ALL_REDUCE || k == OpKind::REDUCE_SCATTER || k == OpKind::REDUCE_SCATTER_V;
  if (k != OpKind::ALL_REDUCE && k != OpKind::BROADCAST && !v && !even && !a2a) return false;
  if (reduces && !PyLong_Check(op_obj.ptr())) return false;
  if (!root_obj.is_none() && !PyLong_CheckExact(root_obj.ptr())) return false;
  const long op = reduces ? PyLong_AsLong(op_obj.ptr()) : 0;
  const long root = root_obj.is_none() ? 0 : PyLong_AsLong(root_obj.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  std::vector<uint64_t> elems, sends;  // recv_counts (v-collectives, all_to_all), send_counts
  if (v && !lean_counts(counts, e.size(), &elems)) return false;
  const bool in_place = out.is_none();
  if ((v || even || a2a) && in_place) return false;
  Array send, recv;
  const Dims dims = v ? Dims::ONE : a2a ? Dims::SHAPE : Dims::ANY;
  if (!plain_array(x.ptr(), in_place, &send, dims)) return false;
  recv = send;
  if (!in_place && (!plain_array(out.ptr(), true, &recv, dims) || recv.dtype != send.dtype)) return false;
  const size_t elem = itemsize(send.dtype);
  uint64_t count = send.bytes / elem;
  if (v) {
    // 1-D: counts are elements. Every size is checked against the arrays' own (no product
    // can overflow: each count is at most an array's element count).
    uint64_t total;
    if (!sum_within(elems, std::max(send.bytes, recv.bytes) / elem, &total)) return false;
    const uint64_t mine = elems[e.rank()];
    const bool gathers = k == OpKind::ALL_GATHER_V;
    if (send.bytes != (gathers ? mine : total) * elem || recv.bytes != (gathers ? total : mine) * elem)
      return false;
    count = mine;
  } else if (even) {
    const uint64_t n = static_cast<uint64_t>(e.size());
    const bool gathers = k == OpKind::ALL_GATHER;
    if ((gathers ? recv.bytes : send.bytes) != n * (gathers ? send.bytes : recv.bytes)) return false;
    count = (gathers ? send.bytes : recv.bytes) / elem;
  } else if (a2a) {
    if (!lean_splits(e, counts, send.shape, recv.shape, &sends, &elems)) return false;
  } else if (!in_place && recv.bytes != send.bytes) {
    return false;
  }
  *args = OpArgs{k, send.dtype, ReduceOp::SUM, 1.0, send.ptr, send.bytes, recv.ptr, recv.bytes,
                 count, 0, -1, 0, std::move(sends), std::move(elems)};
  if (!in_place && overlaps(*args, e.rank())) return false;
  if (reduces) {
    if (op < 0 || op >= static_cast<long>(ReduceOp::COUNT) || op == static_cast<long>(ReduceOp::PREMUL_SUM) ||
        !g_reducible[op][static_cast<size_t>(send.dtype)])
      return false;
    args->op = static_cast<ReduceOp>(op);
  } else if (k == OpKind::BROADCAST) {
    if (!in_place || root < 0 || root >= e.size()) return false;
    args->root = static_cast<int>(root);
  }
  return true;
}

// The lean path of the common call, posted in one native call under the communicator's
// `busy` lock: None when it ran, else LEAN_BUSY or LEAN_SKIPPED (see lean_args).
nb::object run_array(Engine& e, nb::handle busy, int kind, nb::handle x, nb::handle out, nb::handle op_obj,
                     nb::handle root_obj, nb::handle counts, double timeout_s) {
  OpArgs args;
  if (!lean_args(e, kind, x, out, op_obj, root_obj, counts, &args)) return nb::int_(static_cast<int>(LEAN_SKIPPED));
  Busy held(busy);
  if (!held.held()) return nb::int_(static_cast<int>(LEAN_BUSY));
  post_and_wait(e, std::move(args), timeout_s);
  return nb::none();
}

// The lean path's asynchronous form: comm.Work's native form (work.cc) for the posted op of
// communicator `comm`, named `label`, or LEAN_BUSY / LEAN_SKIPPED.
nb::object post_array(Engine& e, nb::handle comm, nb::handle busy, int kind, nb::handle x, nb::handle out,
                      nb::handle op_obj, nb::handle root_obj, nb::handle counts, nb::handle label) {
  OpArgs args;
  if (!lean_args(e, kind, x, out, op_obj, root_obj, counts, &args)) return nb::int_(static_cast<int>(LEAN_SKIPPED));
  Busy held(busy);
  if (!held.held()) return nb::int_(static_cast<int>(LEAN_BUSY));
  // Posted with the GIL held: an async collective's post only queues it (Engine::post holds
  // its lock for a few instructions and never waits for Python), and releasing the GIL
  // around that costs more than the post.
  return binding::make_work(e.post(std::move(args), false), comm, label, x, out);
}

// One buffer of a persistent collective, as registered at set-up.
struct Held {
  nb::object obj;  // keeps the array alive for as long as the handle lives
  uintptr_t ptr;
  size_t nbytes;
  bool write;
  std::string what;  // "input", "output", "buffer"
};

[[noreturn]] void changed(const Held& h, const char* how) {
  PyErr_Format(g_buffer_changed, "the %s buffer %s since the persistent operation was set up; "
               "set it up again with the current buffer", h.what.c_str(), how);
  throw nb::python_error();
}

// The buffer must still be the memory registered at set-up: numpy through the buffer
// protocol, torch tensors through data_ptr / nbytes (resize_, set_ and storage resizes move
// or shrink them).
void check_held(const Held& h) {
  PyObject* obj = h.obj.ptr();
  if (PyObject_CheckBuffer(obj)) {
    View view(obj, h.write);
    if (!view.ok) changed(h, h.write ? "is no longer writable" : "can no longer be read");
    if (reinterpret_cast<uintptr_t>(view.v.buf) != h.ptr || static_cast<size_t>(view.v.len) != h.nbytes ||
        !view.contiguous())
      changed(h, "was resized, reallocated or freed");
    return;
  }
  const auto ptr = nb::cast<uintptr_t>(call(obj, g_names.data_ptr));
  const auto nbytes = nb::cast<size_t>(attr(obj, g_names.nbytes));
  if (ptr != h.ptr || nbytes != h.nbytes || call(obj, g_names.is_contiguous).ptr() != Py_True)
    changed(h, "was resized, reallocated or freed");
}

// A persistent collective of the engine: arguments checked and the algorithm chosen once
// (Engine::prepare); each start re-checks the buffers and posts. After a non-blocking start
// the handle is itself the request (wait / test), so a start builds no Python object.
struct Prepared {
  nb::object engine_obj;  // keeps the engine alive
  Engine* engine;
  OpArgs args;
  std::vector<Held> held;
  std::shared_ptr<Op> started;  // the last non-blocking start's op

  void check() const {
    for (const Held& h : held) check_held(h);
  }
  // Start and wait under the communicator's `busy` lock; false (nothing done) when another
  // thread holds it.
  bool run(nb::handle busy, double timeout_s) {
    Busy held(busy);
    if (!held.held()) return false;
    check();
    post_and_wait(*engine, args, timeout_s);
    return true;
  }
  std::shared_ptr<Op> post(bool blocking) {
    check();
    // An async collective's post only queues it: the GIL stays held (as in post_array).
    // A blocking one runs it, and a send / receive may wait for the peer: those release it.
    if (!blocking && !is_p2p(args.kind)) return engine->post(args, false);
    nb::gil_scoped_release unlocked;
    return engine->post(args, blocking);
  }
  // The non-blocking start under the communicator's `busy` lock: false (nothing done) when
  // another thread holds it.
  bool start(nb::handle busy) {
    Busy held(busy);
    if (!held.held()) return false;
    // The last start's op is reused when it is done and only this handle holds it (the
    // usual case; a thread still letting go of it makes a new one).
    if (started && started->test() && started.use_count() == 1 && !is_p2p(args.kind)) {
      std::atomic_thread_fence(std::memory_order_acquire);  // after the last owner's release
      check();
      engine->repost(started);
    } else {
      started = post(false);
    }
    return true;
  }
  // The last start's op, as a Request's wait / test (done when nothing was started).
  void wait(double timeout_s) {
    if (!started) return;
    std::shared_ptr<Op> op = started;
    nb::gil_scoped_release unlocked;
    op->wait(timeout_s);
  }
  bool test() const { return !started || started->test(); }
};

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

PyObject* native_error = nullptr;  // _native.NativeError
}  // namespace

bool binding::plain_bytes(PyObject* obj, bool writable, uintptr_t* ptr, uint64_t* bytes) {
  Array a;
  if (!plain_array(obj, writable, &a)) return false;
  *ptr = a.ptr;
  *bytes = a.bytes;
  return true;
}

PyObject* binding::intern(const char* name) { return PyUnicode_InternFromString(name); }

nb::object binding::attr(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj, name);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

nb::object binding::engine_exception(const CommError& e) {
  if (e.code == ErrorCode::INTERRUPTED && raised_type) {  // the handler's own exception
    PyErr_NormalizeException(&raised_type, &raised_value, &raised_tb);
    if (raised_tb) PyException_SetTraceback(raised_value, raised_tb);
    nb::object exc = nb::steal(raised_value);
    Py_XDECREF(raised_type);
    Py_XDECREF(raised_tb);
    raised_type = raised_value = raised_tb = nullptr;
    return exc;
  }
  nb::object args = nb::make_tuple(static_cast<int>(e.code), e.peer, e.msg);
  PyObject* exc = PyObject_CallObject(native_error, args.ptr());
  if (!exc) throw nb::python_error();
  return nb::steal(exc);
}

void binding::set_error(nb::handle exc) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

void binding::raise(nb::handle exc) {
  set_error(exc);
  throw nb::python_error();
}

NB_MODULE(_native, m) {
  native_error = PyErr_NewException("comm._native.NativeError", PyExc_RuntimeError, nullptr);
  m.attr("NativeError") = nb::handle(native_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CommError& e) {
      binding::set_error(binding::engine_exception(e));
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
  main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  signal_check = python_signal_raised;
  m.def("kernel_isa", &kernel_isa, "Instruction set the reduction kernels use on this CPU.");
  m.def("algorithm_names", &algorithm_names, "Every algorithm name COMM_ALGO may give the engine.");
  m.def("planned_peers_all", &planned_peers_all, nb::arg("host_of"), nb::arg("algo") = "", release(),
        "Every rank's planned peers (Engine.planned_peers of each) for a job whose rank r is on\n"
        "host host_of[r]: the bootstrap simulation's plan without an engine per rank.");
  // The engine's reduction kernels for transports that reduce outside it (MPI's user-defined
  // operations for float16 / bfloat16, its AVG and PREMUL_SUM steps): one set of kernels, with
  // the engine's rounding, for every transport.
  m.def(
      "reduce_into",
      [](int dtype, int op, uintptr_t acc, uintptr_t in, size_t count) {
        check_codes(0, dtype, op);
        ReduceFn fn = reduce_fn(static_cast<DType>(dtype), static_cast<ReduceOp>(op));
        if (!fn) fail(ErrorCode::INVALID_ARGUMENT, -1, "no reduction kernel for this dtype and op");
        fn(reinterpret_cast<void*>(acc), reinterpret_cast<void*>(acc), reinterpret_cast<const void*>(in), count);
      },
      nb::arg("dtype"), nb::arg("op"), nb::arg("acc"), nb::arg("incoming"), nb::arg("count"), release(),
      "acc[i] = acc[i] op incoming[i] for `count` elements at these addresses (AVG and PREMUL_SUM\n"
      "reduce as SUM: scale() does their extra step).");
  m.def(
      "scale",
      [](int dtype, uintptr_t out, uintptr_t in, size_t count, double factor) {
        check_codes(0, dtype, 0);
        ScaleFn fn = scale_fn(static_cast<DType>(dtype));
        if (!fn) fail(ErrorCode::INVALID_ARGUMENT, -1, "scaling needs a floating-point dtype");
        fn(reinterpret_cast<void*>(out), reinterpret_cast<const void*>(in), count, factor);
      },
      nb::arg("dtype"), nb::arg("out"), nb::arg("input"), nb::arg("count"), nb::arg("factor"), release(),
      "out[i] = input[i] * factor for a floating dtype (PREMUL_SUM inputs, AVG results); out may be input.");
  // Compressed collectives (comm/compress.py): the wire formats' kernels over addresses the
  // Python side sized (it owns the arrays; these only convert). Counts are elements.
  m.def(
      "compress_to_bf16",
      [](uintptr_t in, uintptr_t out, size_t count) {
        compress::kernels().to_bf16(reinterpret_cast<const float*>(in), reinterpret_cast<uint16_t*>(out), count);
      },
      nb::arg("input"), nb::arg("out"), nb::arg("count"), release(),
      "out (bf16) = input (float32), rounded to nearest even; NaN and Inf kept.");
  m.def(
      "compress_bf16_add",
      [](uintptr_t acc, uintptr_t in, size_t count, bool accumulate) {
        compress::kernels().bf16_add(reinterpret_cast<float*>(acc), reinterpret_cast<const uint16_t*>(in), count,
                                     accumulate);
      },
      nb::arg("acc"), nb::arg("input"), nb::arg("count"), nb::arg("accumulate"), release(),
      "acc (float32) = (acc if accumulate else 0) + input (bf16).");
  m.def(
      "compress_to_fp8",
      [](uintptr_t in, uintptr_t codes, uintptr_t scales, size_t count, size_t block) {
        if (block == 0) fail(ErrorCode::INVALID_ARGUMENT, -1, "fp8 block size must be positive");
        compress::kernels().to_fp8(reinterpret_cast<const float*>(in), reinterpret_cast<uint8_t*>(codes),
                                   reinterpret_cast<float*>(scales), count, block);
      },
      nb::arg("input"), nb::arg("codes"), nb::arg("scales"), nb::arg("count"), nb::arg("block"), release(),
      "codes (e4m3 bytes) and scales (one float32 per block) of input (float32).");
  m.def(
      "compress_fp8_add",
      [](uintptr_t acc, uintptr_t codes, uintptr_t scales, size_t count, size_t block, bool accumulate) {
        if (block == 0) fail(ErrorCode::INVALID_ARGUMENT, -1, "fp8 block size must be positive");
        compress::kernels().fp8_add(reinterpret_cast<float*>(acc), reinterpret_cast<const uint8_t*>(codes),
                                    reinterpret_cast<const float*>(scales), count, block, accumulate);
      },
      nb::arg("acc"), nb::arg("codes"), nb::arg("scales"), nb::arg("count"), nb::arg("block"),
      nb::arg("accumulate"), release(),
      "acc (float32) = (acc if accumulate else 0) + codes dequantized with their block's scale.");
  m.def("net_unavailable", &net_unavailable, nb::arg("name"), nb::arg("options"), release(),
        "Why net `name` cannot be opened here, or an empty string when it can.");
  m.def("net_library", &net_library, nb::arg("name"), nb::arg("options"), release(),
        "The library net `name` loads (version, file) and whether the engine supports it.");
  m.def(
      "net_describe",
      [](const std::string& name, const NetOptions& opts) {
        auto net = open_net(name, 0, 1, opts);
        const NetCaps caps = net->caps();
        return "capabilities: host memory " + std::string(caps.host_memory ? "yes" : "no") +
               ", device memory " + (caps.device_memory ? "yes" : "no") + ", largest message " +
               (caps.max_message == UINT64_MAX ? std::string("unlimited") : std::to_string(caps.max_message)) +
               "\n" + net->describe();
      },
      nb::arg("name"), nb::arg("options"), release(),
      "What net `name` sees on this machine (its library's own listing).");
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

  g_names = Names{intern("is_cpu"), intern("dtype"), intern("is_contiguous"), intern("data_ptr"),
                  intern("nbytes"), intern("storage_offset"), intern("untyped_storage"),
                  intern("is_neg"), intern("acquire"), intern("release"), intern("dim"),
                  intern("shape")};
  m.attr("LEAN_SKIPPED") = static_cast<int>(LEAN_SKIPPED);
  m.attr("LEAN_BUSY") = static_cast<int>(LEAN_BUSY);
  g_buffer_changed = PyErr_NewException("comm._native.BufferChanged", PyExc_ValueError, nullptr);
  m.attr("BufferChanged") = nb::handle(g_buffer_changed);
  g_ndarray = nb::object(nb::module_::import_("numpy").attr("ndarray")).release().ptr();
  m.def(
      "set_reducible",
      [](const std::vector<std::vector<bool>>& table) {
        for (size_t op = 0; op < table.size() && op < g_reducible.size(); op++)
          for (size_t t = 0; t < table[op].size() && t < g_reducible[op].size(); t++)
            g_reducible[op][t] = table[op][t];
      },
      "Hand over comm.core.types.op_allowed as table[op][dtype] (the lean path checks with it).");

  nb::class_<Prepared>(m, "Prepared")
      .def("run", &Prepared::run, nb::arg("busy"), nb::arg("timeout_s"),
           "Under the lock `busy` (False, having done nothing, when another thread holds it):\n"
           "check the buffers, post blocking, wait; raises BufferChanged or NativeError.")
      .def(
          "start",
          [](nb::handle_t<Prepared> self, nb::handle busy) -> nb::object {
            if (!nb::inst_ptr<Prepared>(self)->start(busy)) return nb::none();
            return nb::borrow(self);
          },
          nb::arg("busy"),
          "Under the lock `busy`: check the buffers and post without waiting; returns this handle,\n"
          "whose wait / test are then the started operation's, or None (nothing done) when\n"
          "another thread holds the lock.")
      .def("wait", &Prepared::wait, nb::arg("timeout_s"),
           "Wait for the last start (timeout_s < 0: no limit); raises NativeError.")
      .def("test", &Prepared::test, "Whether the last start completed (never blocks).")
      .def("post", &Prepared::post, nb::arg("blocking"),
           "Check the buffers and post; returns a Request, or None when it already ran.");

  nb::class_<BusyLock>(m, "BusyLock", "A non-reentrant lock, as threading.Lock, that the engine's lean calls take natively.")
      .def(nb::init<>())
      .def("acquire", &BusyLock::acquire, nb::arg("blocking") = true)
      .def("release", &BusyLock::release)
      .def("locked", [](const BusyLock& l) { return l.held.load(); });
  g_busy_lock_type = reinterpret_cast<PyTypeObject*>(nb::type<BusyLock>().ptr());

  binding::bind_work(m);
  nb::class_<Op>(m, "Request")
      .def("wait", &Op::wait, nb::arg("timeout_s"), release(),
           "Wait for completion (timeout_s < 0: no limit); raises NativeError.")
      .def("test", &Op::test)  // one atomic load: not worth a GIL release
      .def_prop_ro(
          "source", [](const Op& op) { return op.source; },
          "A completed receive's sender (its rank in the group); -1 for other ops.");

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
      .def("set_hosts", &Engine::set_hosts, nb::arg("host_of"),
           "The host of every rank (equal numbers, same host): the two-level algorithms' topology.")
      .def("add_peer", &Engine::add_peer, nb::arg("peer"), nb::arg("monitor_fd"),
           nb::arg("coll_fds"), nb::arg("p2p_fd"), release(),
           "Hand over connected sockets (the engine owns and closes them).")
      .def(
          "open_net",
          [](Engine& e, const std::string& name, const NetOptions& opts) {
            std::string address;
            {
              nb::gil_scoped_release unlocked;
              address = e.open_net(name, opts);
            }
            return nb::bytes(address.data(), address.size());
          },
          nb::arg("name"), nb::arg("options"),
          "Open net `name` for this engine's data; returns this rank's address to publish.")
      .def(
          "add_net_peer",
          [](Engine& e, int peer, int monitor_fd, nb::bytes address, bool same_host) {
            std::string addr(address.c_str(), address.size());
            nb::gil_scoped_release unlocked;
            e.add_net_peer(peer, monitor_fd, addr, same_host);
          },
          nb::arg("peer"), nb::arg("monitor_fd"), nb::arg("address"), nb::arg("same_host"),
          "Connect `peer` over the open net from the address it published (the engine owns\n"
          "the monitor socket).")
      .def("start", &Engine::start, nb::arg("every_peer") = true, release(),
           "Start the engine; every_peer: each peer must be connected (a full mesh), else peers\n"
           "outside the plan are connected on first use through set_connector's function.")
      .def("planned_peers", &Engine::planned_peers,
           "The peers this rank's algorithms exchange data with (from set_hosts' topology).")
      .def(
          "set_connector",
          [](Engine& e, nb::object fn) {
            if (fn.is_none()) {
              e.set_connector(nullptr);
              return;
            }
            // Released with the GIL held, whichever thread drops the last reference.
            std::shared_ptr<nb::object> held(new nb::object(std::move(fn)), [](nb::object* o) {
              nb::gil_scoped_acquire gil;
              delete o;
            });
            e.set_connector([held](int peer) {
              int code = 0;
              std::string why;
              {
                nb::gil_scoped_acquire gil;
                try {
                  nb::object r = (*held)(peer);
                  if (!r.is_none()) {
                    auto [c, m] = nb::cast<std::tuple<int, std::string>>(r);
                    code = c, why = m;
                  }
                } catch (const std::exception& ex) {
                  code = static_cast<int>(ErrorCode::SYSTEM), why = ex.what();
                }
              }
              if (code) fail(static_cast<ErrorCode>(code), peer, why);
            });
          },
          nb::arg("fn").none(),
          "fn(peer) connects `peer` (add_peer) and returns None, or returns (error code, message).\n"
          "Called from the thread of the operation that first needs the peer. Set before start().")
      .def("first_lost", &Engine::first_lost, release(),
           "A rank known to be gone (first hand or relayed), or -1.")
      .def_prop_ro("connected_on_demand", &Engine::connected_on_demand,
                   "Peers an operation had to connect because the plan did not hold them.")
      .def(
          "post",
          [](Engine& e, int kind, int dtype, int op, double scale, uintptr_t send,
             uint64_t send_bytes, uintptr_t recv, uint64_t recv_bytes, uint64_t count, int root,
             int peer, int tag, std::vector<uint64_t> send_counts,
             std::vector<uint64_t> recv_counts, bool blocking, int wire, uint64_t wire_block) {
            check_codes(kind, dtype, op);  // before the casts: enums hold only known codes
            if (wire < 0 || wire >= static_cast<int>(Wire::COUNT))
              fail(ErrorCode::INVALID_ARGUMENT, -1, "wire format code " + std::to_string(wire) + " is unknown");
            OpArgs args{static_cast<OpKind>(kind), static_cast<DType>(dtype), static_cast<ReduceOp>(op),
                        scale, send, send_bytes, recv, recv_bytes, count, root, peer, tag,
                        std::move(send_counts), std::move(recv_counts)};
            args.wire = static_cast<Wire>(wire);
            args.wire_block = wire_block;
            return e.post(std::move(args), blocking);
          },
          nb::arg("kind"), nb::arg("dtype"), nb::arg("op"), nb::arg("scale"), nb::arg("send"),
          nb::arg("send_bytes"), nb::arg("recv"), nb::arg("recv_bytes"), nb::arg("count"), nb::arg("root"),
          nb::arg("peer"), nb::arg("tag"), nb::arg("send_counts"), nb::arg("recv_counts"), nb::arg("blocking"),
          nb::arg("wire") = 0, nb::arg("wire_block") = 0, release(),
          "Post one operation (send_bytes / recv_bytes: the sizes of the memory at send / recv, which\n"
          "the engine never reads or writes past); returns a Work, or None when it already ran to\n"
          "completion. wire: 0 exact, 1 bf16, 2 fp8 (a float32 all_reduce, reduce_scatter,\n"
          "all_gather or v form compressed between hosts; wire_block: fp8's elements per scale).")
      .def("run_array", &run_array, nb::arg("busy"), nb::arg("kind"), nb::arg("x"), nb::arg("out").none(),
           nb::arg("op").none(), nb::arg("root").none(), nb::arg("counts").none(), nb::arg("timeout_s"),
           "The lean path, under the lock `busy`: None when it ran the collective, LEAN_BUSY\n"
           "when another thread holds the lock, LEAN_SKIPPED when the arguments are not plain\n"
           "numpy arrays or CPU tensors of matching sizes with a built-in op (for a v-collective\n"
           "1-D ones and `counts`, a list of ints); then take the full path.")
      .def("post_array", &post_array, nb::arg("comm"), nb::arg("busy"), nb::arg("kind"), nb::arg("x"),
           nb::arg("out").none(), nb::arg("op").none(), nb::arg("root").none(), nb::arg("counts").none(),
           nb::arg("label"),
           "run_array's asynchronous form for communicator `comm`: its comm.Work (a LeanWork),\n"
           "or LEAN_BUSY / LEAN_SKIPPED.")
      .def(
          "prepare",
          [](nb::handle self, int kind, int dtype, int op, double scale, uintptr_t send,
             uint64_t send_bytes, uintptr_t recv, uint64_t recv_bytes, uint64_t count, int root,
             std::vector<uint64_t> send_counts, std::vector<uint64_t> recv_counts,
             std::vector<std::tuple<nb::object, uintptr_t, size_t, bool, std::string>> held) {
            Engine& e = nb::cast<Engine&>(self);
            check_codes(kind, dtype, op);
            OpArgs args{static_cast<OpKind>(kind), static_cast<DType>(dtype), static_cast<ReduceOp>(op),
                        scale, send, send_bytes, recv, recv_bytes, count, root, -1, 0,
                        std::move(send_counts), std::move(recv_counts)};
            Prepared p{nb::borrow(self), &e, e.prepare(std::move(args)), {}, nullptr};
            for (auto& [obj, ptr, nbytes, write, what] : held)
              p.held.push_back(Held{std::move(obj), ptr, nbytes, write, std::move(what)});
            return p;
          },
          "A persistent collective, validated as post() validates; held: (array, ptr, nbytes,\n"
          "written, name) per buffer, re-checked at each start.")
      .def(
          "recent_ops",
          [](const Engine& e) {
            std::vector<std::tuple<uint64_t, int, int, uint64_t, int, std::string, double>> out;
            for (const RecentOp& r : e.recent_ops())
              out.emplace_back(r.seq, static_cast<int>(r.kind), static_cast<int>(r.dtype), r.count,
                               r.root, r.state, r.started);
            return out;
          },
          "The engine's flight recorder: (seq, kind, dtype, count, root, state, started).")
      .def(
          "forget_after_fork",
          [](nb::handle self) {
            nb::cast<Engine&>(self).forget_after_fork();
            self.inc_ref();  // never destroyed in the child: see Engine::forget_after_fork
            nb::set_leak_warnings(false);  // so the child's exit reports it as no bug
          },
          "In a forked child: drop this process's copies of the connections; leaks the engine.")
      .def("abort", &Engine::abort, release())
      .def("revoke", &Engine::revoke, release())
      .def("dead_peers", &Engine::dead_peers, release())
      .def("close", &Engine::close, release())
      .def_prop_ro("last_algorithm", &Engine::last_algorithm);

  binding::bind_window(m);  // binding_window.cc
}
