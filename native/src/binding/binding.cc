// The Python face of the engine (module comm._native). Every call releases the GIL where it may
// wait; engine errors are raised as the comm.core.errors classes (errors.cc). The full path's
// entry takes the communicator's OpDesc itself (op_args), the lean path its Python objects
// (lean.cc).
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>

#include "algorithms/algorithms.h"
#include "binding/binding.h"
#include "kernels/compress.h"
#include "core/engine.h"
#include "kernels/reduce.h"

namespace nb = nanobind;
using namespace comm;
using binding::attr;
using binding::call;
using binding::intern;

namespace {

using release = nb::call_guard<nb::gil_scoped_release>;

// The OpDesc fields (comm/core/ops.py) and a Buffer's, interned once at import.
struct DescNames {
  PyObject *kind, *send, *recv, *dtype, *count, *op, *scale, *root, *peer, *tag, *send_counts, *recv_counts,
      *wire, *wire_block, *ptr, *nbytes, *data_ptr, *is_contiguous;
};
DescNames g_desc{};

// OpDesc.wire ("bf16", "fp8"; None: exact) as the engine's code (common.h: Wire); an int is
// taken as the code itself (a caller of comm._native), which check_op range-checks.
Wire wire_of(nb::handle w) {
  if (w.is_none()) return Wire::EXACT;
  if (PyUnicode_Check(w.ptr())) {
    const std::string name = nb::cast<std::string>(w);
    if (name == "bf16") return Wire::BF16;
    if (name == "fp8") return Wire::FP8;
    fail(ErrorCode::INVALID_ARGUMENT, -1, "wire format '" + name + "' is unknown");
  }
  const long code = nb::cast<long>(w);
  if (code < 0 || code > 255) fail(ErrorCode::INVALID_ARGUMENT, -1, "wire format code " + std::to_string(code) + " is unknown");
  return static_cast<Wire>(code);
}

// The engine's arguments of one OpDesc, read by field name: the one structure both sides
// know. A broadcast has one buffer (recv, or send where only it is given). Throws
// INVALID_ARGUMENT for fields of the wrong type or codes out of range.
OpArgs op_args(nb::handle desc) {
  const DescNames& n = g_desc;
  PyObject* d = desc.ptr();
  try {
    const int kind = nb::cast<int>(attr(d, n.kind)), dtype = nb::cast<int>(attr(d, n.dtype));
    const int op = nb::cast<int>(attr(d, n.op));
    check_codes(kind, dtype, op);  // before the casts: enums hold only known codes
    nb::object send = attr(d, n.send), recv = attr(d, n.recv);
    if (static_cast<OpKind>(kind) == OpKind::BROADCAST) {
      if (recv.is_none()) recv = send;
      send = recv;
    }
    auto where = [&](const nb::object& buf) {
      return buf.is_none() ? std::pair<uintptr_t, uint64_t>{0, 0}
                           : std::pair{nb::cast<uintptr_t>(attr(buf.ptr(), n.ptr)), nb::cast<uint64_t>(attr(buf.ptr(), n.nbytes))};
    };
    auto counts = [&](PyObject* name) {
      nb::object c = attr(d, name);
      return c.is_none() ? std::vector<uint64_t>{} : nb::cast<std::vector<uint64_t>>(c);
    };
    const auto [sp, sb] = where(send);
    const auto [rp, rb] = where(recv);
    OpArgs args{static_cast<OpKind>(kind), static_cast<DType>(dtype), static_cast<ReduceOp>(op),
                nb::cast<double>(attr(d, n.scale)), sp, sb, rp, rb,
                nb::cast<uint64_t>(attr(d, n.count)), nb::cast<int>(attr(d, n.root)),
                nb::cast<int>(attr(d, n.peer)), nb::cast<int>(attr(d, n.tag)),
                counts(n.send_counts), counts(n.recv_counts)};
    args.wire = wire_of(attr(d, n.wire));
    args.wire_block = nb::cast<uint64_t>(attr(d, n.wire_block));
    return args;
  } catch (const nb::cast_error&) {
    fail(ErrorCode::INVALID_ARGUMENT, -1, "an operation field has the wrong type or is out of range");
  }
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
  fail(ErrorCode::INVALID_ARGUMENT, -1,
       "the " + h.what + " buffer " + how + " since the persistent operation was set up; set it up again "
       "with the current buffer");
}

// The buffer must still be the memory registered at set-up: numpy through the buffer
// protocol, torch tensors through data_ptr / nbytes (resize_, set_ and storage resizes move
// or shrink them).
void check_held(const Held& h) {
  PyObject* obj = h.obj.ptr();
  if (PyObject_CheckBuffer(obj)) {
    binding::View view(obj, h.write);
    if (!view.ok) changed(h, h.write ? "is no longer writable" : "can no longer be read");
    if (reinterpret_cast<uintptr_t>(view.v.buf) != h.ptr || static_cast<size_t>(view.v.len) != h.nbytes ||
        !view.contiguous())
      changed(h, "was resized, reallocated or freed");
    return;
  }
  const auto ptr = nb::cast<uintptr_t>(call(obj, g_desc.data_ptr));
  const auto nbytes = nb::cast<size_t>(attr(obj, g_desc.nbytes));
  if (ptr != h.ptr || nbytes != h.nbytes || call(obj, g_desc.is_contiguous).ptr() != Py_True)
    changed(h, "was resized, reallocated or freed");
}

// Post on the caller's thread; an op queued behind async work is waited for here.
void post_and_wait(Engine& e, const OpArgs& args, double timeout_s) {
  nb::gil_scoped_release unlocked;
  if (auto op = e.post(args, true)) op->wait(timeout_s);
}

// A persistent collective of the engine: arguments checked and the algorithm chosen once
// (Engine::prepare); each start re-checks the buffers and posts. After a non-blocking start
// the handle is itself the request (wait / test), so a start builds no Python object.
// Every method raises the engine's errors located at this rank and operation.
struct Prepared {
  nb::object engine_obj;  // keeps the engine alive
  Engine* engine;
  OpArgs args;
  std::vector<Held> held;
  std::shared_ptr<Op> started;  // the last non-blocking start's op

  template <class F>
  auto located(F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const CommError& e) {
      binding::raise_engine(e, engine->rank(), kind_name(args.kind));
    }
  }
  void check() const {
    for (const Held& h : held) check_held(h);
  }
  // Start and wait under the communicator's `busy` lock; false (nothing done) when another
  // thread holds it.
  bool run(nb::handle busy, double timeout_s) {
    binding::Busy lock(busy);
    if (!lock.held()) return false;
    located([&] {
      check();
      post_and_wait(*engine, args, timeout_s);
    });
    return true;
  }
  std::shared_ptr<Op> post_op(bool blocking) {
    check();
    // An async collective's post only queues it: the GIL stays held (as in post_array).
    // A blocking one runs it, and a send / receive may wait for the peer: those release it.
    if (!blocking && !is_p2p(args.kind)) return engine->post(args, false);
    nb::gil_scoped_release unlocked;
    return engine->post(args, blocking);
  }
  // The request of a start through the communicator's general path, or None when it ran.
  nb::object post(bool blocking) {
    std::shared_ptr<Op> op = located([&] { return post_op(blocking); });
    return op ? binding::make_request(std::move(op), engine->rank()) : nb::none();
  }
  // The non-blocking start under the communicator's `busy` lock: false (nothing done) when
  // another thread holds it.
  bool start(nb::handle busy) {
    binding::Busy lock(busy);
    if (!lock.held()) return false;
    located([&] {
      // The last start's op is reused when it is done and only this handle holds it (the
      // usual case; a thread still letting go of it makes a new one).
      if (started && started->test() && started.use_count() == 1 && !is_p2p(args.kind)) {
        std::atomic_thread_fence(std::memory_order_acquire);  // after the last owner's release
        check();
        engine->repost(started);
      } else {
        started = post_op(false);
      }
    });
    return true;
  }
  // The last start's op, as a Request's wait / test (done when nothing was started).
  void wait(nb::handle timeout) {
    if (!started) return;
    const double t = timeout.is_none() ? -1.0 : nb::cast<double>(timeout);
    std::shared_ptr<Op> op = started;
    located([&] {
      nb::gil_scoped_release unlocked;
      op->wait(t);
    });
  }
  bool test() const { return !started || started->test(); }
};

}  // namespace

PyObject* binding::intern(const char* name) { return PyUnicode_InternFromString(name); }

nb::object binding::attr(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_GetAttr(obj, name);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

nb::object binding::call(PyObject* obj, PyObject* name) {
  PyObject* r = PyObject_CallMethodNoArgs(obj, name);
  if (!r) throw nb::python_error();
  return nb::steal(r);
}

NB_MODULE(_native, m) {
  binding::bind_errors(m);  // errors.cc: first, so that every later failure is one of them
  binding::bind_lean(m);    // lean.cc
  g_desc = DescNames{intern("kind"), intern("send"), intern("recv"), intern("dtype"), intern("count"),
                     intern("op"), intern("scale"), intern("root"), intern("peer"), intern("tag"),
                     intern("send_counts"), intern("recv_counts"), intern("wire"), intern("wire_block"),
                     intern("ptr"), intern("nbytes"), intern("data_ptr"), intern("is_contiguous")};
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

  nb::class_<Prepared>(m, "Prepared")
      .def("run", &Prepared::run, nb::arg("busy"), nb::arg("timeout_s"),
           "Under the lock `busy` (False, having done nothing, when another thread holds it):\n"
           "check the buffers, post blocking, wait; raises the operation's CommError.")
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
      .def("wait", &Prepared::wait, nb::arg("timeout").none() = nb::none(),
           "Wait for the last start (None: no limit); raises the operation's CommError.")
      .def("test", &Prepared::test, "Whether the last start completed (never blocks).")
      .def("post", &Prepared::post, nb::arg("blocking"),
           "Check the buffers and post; returns a Request, or None when it already ran.");

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
          [](Engine& e, nb::handle desc, bool blocking) -> nb::object {
            std::shared_ptr<Op> op;
            OpKind kind = OpKind::COUNT;  // unknown until the descriptor is read
            try {
              OpArgs args = op_args(desc);
              kind = args.kind;
              nb::gil_scoped_release unlocked;
              op = e.post(std::move(args), blocking);
            } catch (const CommError& err) {
              binding::raise_engine(err, e.rank(), kind == OpKind::COUNT ? nullptr : kind_name(kind));
            }
            return op ? binding::make_request(std::move(op), e.rank()) : nb::none();
          },
          nb::arg("desc"), nb::arg("blocking"),
          "Post one comm.core.ops.OpDesc (its buffers' ptr / nbytes: the memory the engine may\n"
          "touch, never past it); returns a Request, or None when it already ran to completion.\n"
          "desc.wire: None exact, \"bf16\" or \"fp8\" (a float32 all_reduce, reduce_scatter,\n"
          "all_gather or v form compressed between hosts; wire_block: fp8's elements per scale).")
      .def("run_array", &binding::run_array, nb::arg("busy"), nb::arg("kind"), nb::arg("x"), nb::arg("out").none(),
           nb::arg("op").none(), nb::arg("root").none(), nb::arg("counts").none(), nb::arg("timeout_s"),
           "The lean path, under the lock `busy`: None when it ran the collective, LEAN_BUSY\n"
           "when another thread holds the lock, LEAN_SKIPPED when the arguments are not plain\n"
           "numpy arrays or CPU tensors of matching sizes with a built-in op (for a v-collective\n"
           "1-D ones and `counts`, a list of ints); then take the full path.")
      .def("post_array", &binding::post_array, nb::arg("busy"), nb::arg("kind"), nb::arg("x"),
           nb::arg("out").none(), nb::arg("op").none(), nb::arg("root").none(), nb::arg("counts").none(),
           nb::arg("label"),
           "run_array's asynchronous form: the posted operation's Request (its errors named\n"
           "`label`; the caller holds x and out until it ends), or LEAN_BUSY / LEAN_SKIPPED.")
      .def(
          "prepare",
          [](nb::handle self, nb::handle desc,
             std::vector<std::tuple<nb::object, uintptr_t, size_t, bool, std::string>> held) {
            Engine& e = nb::cast<Engine&>(self);
            OpKind kind = OpKind::COUNT;
            try {
              OpArgs args = op_args(desc);
              kind = args.kind;
              Prepared p{nb::borrow(self), &e, e.prepare(std::move(args)), {}, nullptr};
              for (auto& [obj, ptr, nbytes, write, what] : held)
                p.held.push_back(Held{std::move(obj), ptr, nbytes, write, std::move(what)});
              return p;
            } catch (const CommError& err) {
              binding::raise_engine(err, e.rank(), kind == OpKind::COUNT ? nullptr : kind_name(kind));
            }
          },
          nb::arg("desc"), nb::arg("held"),
          "A persistent collective of an OpDesc, validated as post() validates; held: (array, ptr,\n"
          "nbytes, written, name) per buffer, re-checked at each start.")
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
