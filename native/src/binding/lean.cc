// The lean path: the common call (all_reduce, broadcast, all_gather, reduce_scatter, their v
// forms and all_to_all of plain arrays) turned into one engine post inside one native call.
// On small messages Python's per-call cost is most of the latency; this path reads the
// Python objects here and takes only the plain case, checked by the engine's own check_op
// (validate.cc) in its EXACT form. Anything else it leaves, having touched nothing, to the
// communicator's full path, whose checks name the problem.
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <array>

#include <sched.h>

#include "binding/binding.h"
#include "core/engine.h"

namespace comm::binding {
namespace {

PyObject* g_ndarray = nullptr;  // numpy.ndarray: the one type read through the buffer protocol
PyTypeObject* g_busy_lock_type = nullptr;

// Attribute and method names of the hot calls, interned once at import: a C-string name
// would be turned into a new str object on every access.
struct Names {
  PyObject *is_cpu, *dtype, *is_contiguous, *data_ptr, *nbytes, *storage_offset, *untyped_storage,
      *is_neg, *acquire, *release, *dim, *shape;
};
Names g_names{};

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

// all_to_all's splits, in elements, of arrays of these shapes: `counts` None for equal blocks,
// or (out_splits, in_splits), rows of dim 0 as lists or tuples of ints; rows of one shape in
// both arrays. False for anything else (check_op then checks the sums against the arrays).
bool lean_splits(int n, nb::handle counts, const std::vector<uint64_t>& in_shape,
                 const std::vector<uint64_t>& out_shape, std::vector<uint64_t>* sends,
                 std::vector<uint64_t>* expects) {
  if (in_shape.size() != out_shape.size() || !std::equal(in_shape.begin() + 1, in_shape.end(), out_shape.begin() + 1))
    return false;
  // Elements per row. The product can wrap only for an array of no rows, whose splits are
  // all 0; check_op compares every block with the bytes handed over anyway.
  uint64_t row = 1;
  for (size_t d = 1; d < in_shape.size(); d++) row *= in_shape[d];
  if (!row) return false;  // rows of no elements: the full path's edge case
  if (counts.is_none()) {
    if (in_shape[0] % n) return false;
    sends->assign(n, in_shape[0] / n * row);
    *expects = *sends;
    return true;
  }
  PyObject* pair = counts.ptr();
  if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
      !lean_counts(nb::handle(PyTuple_GET_ITEM(pair, 0)), n, expects) ||
      !lean_counts(nb::handle(PyTuple_GET_ITEM(pair, 1)), n, sends))
    return false;
  for (auto* splits : {sends, expects})
    for (uint64_t& k : *splits)
      if (__builtin_mul_overflow(k, row, &k)) return false;
  return true;
}

// The arguments of the lean path's call: all_reduce (in place or into `out`) or broadcast of
// one plain array, all_gather / reduce_scatter between two, all_gather_v / reduce_scatter_v
// between plain 1-D arrays with `counts`, or all_to_all between plain arrays with rows of one
// shape, `counts` None (equal blocks) or (out_splits, in_splits); false, having touched
// nothing, for anything else.
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
  if (reduces && (op < 0 || op >= static_cast<long>(ReduceOp::COUNT) || op == static_cast<long>(ReduceOp::PREMUL_SUM)))
    return false;  // PREMUL_SUM needs its scale: the full path's
  if (root < INT32_MIN || root > INT32_MAX) return false;
  std::vector<uint64_t> elems, sends;  // recv_counts (v-collectives, all_to_all), send_counts
  if (v && !lean_counts(counts, e.size(), &elems)) return false;
  const bool in_place = out.is_none();
  if (in_place ? v || even || a2a : k == OpKind::BROADCAST) return false;  // those need `out`; broadcast has one buffer
  Array send, recv;
  const Dims dims = v ? Dims::ONE : a2a ? Dims::SHAPE : Dims::ANY;
  if (!plain_array(x.ptr(), in_place, &send, dims)) return false;
  recv = send;
  if (!in_place && (!plain_array(out.ptr(), true, &recv, dims) || recv.dtype != send.dtype)) return false;
  const uint64_t elem = itemsize(send.dtype);
  // this rank's block: the whole input for all_reduce, broadcast and all_gather
  uint64_t count = send.bytes / elem;
  if (v) count = elems[e.rank()];
  else if (k == OpKind::REDUCE_SCATTER) count = recv.bytes / elem;
  else if (a2a && !lean_splits(e.size(), counts, send.shape, recv.shape, &sends, &elems)) return false;
  *args = OpArgs{k, send.dtype, static_cast<ReduceOp>(op), 1.0, send.ptr, send.bytes, recv.ptr, recv.bytes,
                 count, static_cast<int>(root), -1, 0, std::move(sends), std::move(elems)};
  try {
    check_op(*args, e.rank(), e.size(), Fit::EXACT);
  } catch (const CommError&) {
    return false;
  }
  return true;
}

// Post on the caller's thread; an op queued behind async work is waited for here.
void post_and_wait(Engine& e, OpArgs args, double timeout_s) {
  nb::gil_scoped_release unlocked;
  if (auto op = e.post(std::move(args), true)) op->wait(timeout_s);
}

}  // namespace

bool BusyLock::acquire(bool blocking) {
  if (try_acquire()) return true;
  if (!blocking) return false;
  nb::gil_scoped_release unlocked;
  while (!try_acquire()) sched_yield();
  return true;
}

void BusyLock::release() {
  if (!held.exchange(false, std::memory_order_release)) throw std::runtime_error("release unlocked lock");
}

Busy::Busy(nb::handle lock) : lock_(lock.ptr()) {
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

Busy::~Busy() {
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

bool plain_bytes(PyObject* obj, bool writable, uintptr_t* ptr, uint64_t* bytes) {
  Array a;
  if (!plain_array(obj, writable, &a)) return false;
  *ptr = a.ptr;
  *bytes = a.bytes;
  return true;
}

// Under the communicator's `busy` lock: None when it ran, else LEAN_BUSY or LEAN_SKIPPED.
nb::object run_array(Engine& e, nb::handle busy, int kind, nb::handle x, nb::handle out, nb::handle op,
                     nb::handle root, nb::handle counts, double timeout_s) {
  OpArgs args;
  if (!lean_args(e, kind, x, out, op, root, counts, &args)) return nb::int_(static_cast<int>(LEAN_SKIPPED));
  Busy held(busy);
  if (!held.held()) return nb::int_(static_cast<int>(LEAN_BUSY));
  try {
    post_and_wait(e, std::move(args), timeout_s);
  } catch (const CommError& err) {
    raise_engine(err, e.rank(), kind_name(static_cast<OpKind>(kind)));
  }
  return nb::none();
}

// The asynchronous form: the engine's Request, or LEAN_BUSY / LEAN_SKIPPED.
nb::object post_array(Engine& e, nb::handle busy, int kind, nb::handle x, nb::handle out, nb::handle op,
                      nb::handle root, nb::handle counts, nb::handle label) {
  OpArgs args;
  if (!lean_args(e, kind, x, out, op, root, counts, &args)) return nb::int_(static_cast<int>(LEAN_SKIPPED));
  Busy held(busy);
  if (!held.held()) return nb::int_(static_cast<int>(LEAN_BUSY));
  // Posted with the GIL held: an async collective's post only queues it (Engine::post holds
  // its lock for a few instructions and never waits for Python), and releasing the GIL
  // around that costs more than the post.
  std::shared_ptr<Op> posted;
  try {
    posted = e.post(std::move(args), false);
  } catch (const CommError& err) {
    raise_engine(err, e.rank(), kind_name(static_cast<OpKind>(kind)));
  }
  return make_request(std::move(posted), e.rank(), label);
}

void bind_lean(nb::module_& m) {
  g_names = Names{intern("is_cpu"), intern("dtype"), intern("is_contiguous"), intern("data_ptr"),
                  intern("nbytes"), intern("storage_offset"), intern("untyped_storage"),
                  intern("is_neg"), intern("acquire"), intern("release"), intern("dim"),
                  intern("shape")};
  m.attr("LEAN_SKIPPED") = static_cast<int>(LEAN_SKIPPED);
  m.attr("LEAN_BUSY") = static_cast<int>(LEAN_BUSY);
  g_ndarray = nb::object(nb::module_::import_("numpy").attr("ndarray")).release().ptr();
  nb::class_<BusyLock>(m, "BusyLock", "A non-reentrant lock, as threading.Lock, that the engine's lean calls take natively.")
      .def(nb::init<>())
      .def("acquire", &BusyLock::acquire, nb::arg("blocking") = true)
      .def("release", &BusyLock::release)
      .def("locked", [](const BusyLock& l) { return l.held.load(); });
  g_busy_lock_type = reinterpret_cast<PyTypeObject*>(nb::type<BusyLock>().ptr());
}

}  // namespace comm::binding
