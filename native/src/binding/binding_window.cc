// The Python face of one-sided windows (window.h; transports/native/__init__.py's NativeWindow).
//
// Besides the plain calls (which take addresses the Python layer checked), the lean calls
// take the Python objects as they come: w.put(peer, array, offset) + w.flush(peer) to a peer
// whose window is mapped is a memcpy and a fence, and Python's per-call cost (argument
// parsing, a Buffer object, dict lookups, a reference kept until the flush) would otherwise
// be most of its time. A lean call handles only the plain case - exact ints in range, a
// C-contiguous numpy array or CPU tensor - and returns SKIPPED for anything else, having
// moved nothing: comm/window.py then takes its full path, which names the error.
#include <nanobind/ndarray.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <climits>

#include "binding/binding.h"
#include "core/engine.h"

namespace nb = nanobind;
using namespace comm;

namespace {

using release = nb::call_guard<nb::gil_scoped_release>;

// What put_lean / get_lean return: the bytes moved inside the call (nothing to hold), they
// are in flight on the message path (the caller holds the buffer until the flush), or the
// arguments are not the plain case (the caller takes the full path).
enum LeanMove { MOVED = 1, POSTED = 0, SKIPPED = -1 };

// Copies this small, on the memcpy / CMA paths, keep the GIL: releasing and taking it back
// costs more than they do.
constexpr uint64_t kInlineBytes = 64 << 10;

// An exact Python int in [lo, hi), else false (nothing raised).
bool small_int(nb::handle h, long long lo, long long hi, long long* out) {
  if (!PyLong_CheckExact(h.ptr())) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *out = v;
  return v >= lo && v < hi;
}

int lean_move(Window& w, bool is_put, nb::handle peer_h, nb::handle buf_h, nb::handle offset_h, nb::handle signal_h) {
  long long peer, offset, signal = -1;
  if (!w.connected() || !small_int(peer_h, 0, w.ranks(), &peer) || !small_int(offset_h, 0, LLONG_MAX, &offset))
    return SKIPPED;
  if (!signal_h.is_none() && !small_int(signal_h, 0, w.signal_count(), &signal)) return SKIPPED;
  uintptr_t ptr;
  uint64_t len;
  if (!binding::plain_bytes(buf_h.ptr(), !is_put, &ptr, &len)) return SKIPPED;
  const int p = static_cast<int>(peer);
  const uint64_t size = w.size_of(p);
  if (static_cast<uint64_t>(offset) > size || len > size - static_cast<uint64_t>(offset)) return SKIPPED;
  auto move = [&] {
    return is_put ? w.put(p, ptr, len, offset, static_cast<int>(signal)) : w.get(p, ptr, len, offset);
  };
  if (len <= kInlineBytes && w.moves_in_call(p)) return move() ? MOVED : POSTED;
  nb::gil_scoped_release unlocked;
  return move() ? MOVED : POSTED;
}

}  // namespace

void binding::bind_window(nb::module_& m) {
  using WindowPeerTuple = std::tuple<uint64_t, uint64_t, uint32_t, int, int>;  // addr, size, id, pid, fd
  nb::class_<Window>(m, "Window")
      .def_prop_ro("id", &Window::id)
      .def_prop_ro("signal_fd", &Window::signal_fd)
      .def_prop_ro("memory_fd", &Window::memory_fd)
      .def_prop_ro(
          "rma_key", [](const Window& w) { return nb::bytes(w.rma_key().data(), w.rma_key().size()); },
          "What peers need to reach this window by RMA (b'' where the net has none).")
      .def("path", &Window::path, nb::arg("peer"),
           "How this rank reaches peer's window: self, mapped, cma, rma or message.")
      .def(
          "connect",
          [](Window& w, const std::vector<WindowPeerTuple>& peers, const std::vector<int>& memory_fds,
             const std::vector<nb::bytes>& keys) {
            std::vector<WindowPeer> all;
            for (const auto& [addr, size, id, pid, fd] : peers) all.push_back({addr, size, id, pid, fd});
            std::vector<std::string> rma_keys;
            for (const nb::bytes& k : keys) rma_keys.emplace_back(k.c_str(), k.size());
            nb::gil_scoped_release unlocked;
            w.connect(all, memory_fds, rma_keys);
          },
          nb::arg("peers"), nb::arg("memory_fds") = std::vector<int>{}, nb::arg("keys") = std::vector<nb::bytes>{},
          "Every rank's (address, size, window id, pid, signal segment fd), in rank order, every\n"
          "rank's memory_fd (allocated windows; empty: none) and rma_key (empty: no RMA).")
      .def("put", &Window::put, nb::arg("peer"), nb::arg("src"), nb::arg("nbytes"), nb::arg("offset"),
           nb::arg("signal"), release())
      .def("get", &Window::get, nb::arg("peer"), nb::arg("dst"), nb::arg("nbytes"), nb::arg("offset"), release())
      .def("flush", &Window::flush, nb::arg("peer"), nb::arg("timeout_s"), release())
      .def("wait_signal", &Window::wait_signal, nb::arg("k"), nb::arg("value"), nb::arg("timeout_s"), release())
      .def("signal", &Window::signal, nb::arg("k"))  // one atomic load
      .def("close", &Window::close, release())
      .def(
          "put_lean",
          [](Window& w, nb::handle peer, nb::handle src, nb::handle offset, nb::handle signal) {
            return lean_move(w, true, peer, src, offset, signal);
          },
          nb::arg("peer"), nb::arg("src"), nb::arg("offset"), nb::arg("signal").none(),
          "put of a plain array: MOVED (done), POSTED (hold src until the flush) or SKIPPED.")
      .def(
          "get_lean",
          [](Window& w, nb::handle peer, nb::handle dst, nb::handle offset) {
            return lean_move(w, false, peer, dst, offset, nb::none());
          },
          nb::arg("peer"), nb::arg("dst"), nb::arg("offset"),
          "get into a plain writable array: MOVED (done), POSTED (hold dst until the flush) or SKIPPED.")
      .def(
          "flush_lean",
          [](Window& w, nb::handle peer_h) {
            long long peer = -1;
            if (!w.connected() || (!peer_h.is_none() && !small_int(peer_h, 0, w.ranks(), &peer))) return false;
            return w.flush_in_call(static_cast<int>(peer));
          },
          nb::arg("peer").none(),
          "flush(peer) when nothing to it is on the message path (True), else False: flush() waits.")
      .def(
          "wait_signal_lean",
          [](Window& w, nb::handle k_h, nb::handle value_h, double timeout_s) {
            long long k;
            if (!small_int(k_h, 0, w.signal_count(), &k) || !PyLong_CheckExact(value_h.ptr())) return false;
            const unsigned long long value = PyLong_AsUnsignedLongLong(value_h.ptr());
            if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {  // negative, or past 64 bits
              PyErr_Clear();
              return false;
            }
            if (w.signal(static_cast<uint32_t>(k)) >= value) return true;  // there already: no GIL round trip
            nb::gil_scoped_release unlocked;
            w.wait_signal(static_cast<uint32_t>(k), value, timeout_s);
            return true;
          },
          nb::arg("k"), nb::arg("value"), nb::arg("timeout_s"),
          "wait_signal for plain ints in range (True once there), else False: nothing waited.")
      .def(
          "memory",
          [](Window& w) -> nb::object {
            const std::shared_ptr<WindowSegment>& seg = w.segment();
            if (!seg) return nb::none();
            // The array owns a reference to the segment: its memory stays while the array does.
            nb::capsule owner(new std::shared_ptr<WindowSegment>(seg),
                              [](void* p) noexcept { delete static_cast<std::shared_ptr<WindowSegment>*>(p); });
            const size_t shape[1] = {static_cast<size_t>(seg->size())};
            return nb::cast(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(seg->base(), 1, shape, owner));
          },
          "This rank's allocated window memory as a numpy uint8 array (None: user memory).");
  m.attr("WINDOW_MOVED") = static_cast<int>(MOVED);
  m.attr("WINDOW_POSTED") = static_cast<int>(POSTED);
  m.attr("WINDOW_SKIPPED") = static_cast<int>(SKIPPED);
  m.def(
      "window",
      [](Engine& e, uintptr_t base, uint64_t size, uint32_t signals) {
        nb::gil_scoped_release unlocked;
        return e.window(base, size, signals);
      },
      nb::arg("engine"), nb::arg("base"), nb::arg("size"), nb::arg("signals"), nb::keep_alive<0, 1>(),
      "This rank's window of `engine` over [base, base + size) with `signals` counters (then connect()).");
  m.def(
      "window_allocate",
      [](Engine& e, uint64_t size, uint32_t signals) {
        nb::gil_scoped_release unlocked;
        std::shared_ptr<WindowSegment> seg = WindowSegment::allocate(size);
        std::shared_ptr<Window> w = e.window(reinterpret_cast<uintptr_t>(seg->base()), size, signals);
        w->adopt(std::move(seg));
        return w;
      },
      nb::arg("engine"), nb::arg("size"), nb::arg("signals"), nb::keep_alive<0, 1>(),
      "As window(), over `size` bytes the library allocates in shared memory that the ranks on\n"
      "this host map (then connect() with every rank's memory_fd).");
}
