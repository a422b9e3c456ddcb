"""Compressed collectives: fewer bits on the wire between hosts, sums kept in float32.

    world.all_reduce(grad, compress="bf16")     # or "fp8"; likewise reduce_scatter,
                                                # all_gather, their v forms and *_init

This module decides whether a call compresses (COMM_COMPRESS, measured under auto) and hands
it to the one algorithm there is, the native engine's (native/src/algorithms/twolevel_compress.cc).
A transport whose engine does not compress (mpi) runs its compressed calls on a sibling native
communicator over the same ranks: the data then moves over the engine's channels (shared memory
on a host, TCP across hosts), not over MPI. docs/compress.md has the formats, their error
bounds, when auto compresses, and what the mpi transport does.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import replace

import numpy as np

from .core import config, log
from .core.buffers import as_buffer
from .core.errors import CommError, TransportUnavailable, from_os_error
from .core.ops import OpDesc, OpKind
from .core.types import DType, ReduceOp
from .work import Work

try:   # the kernels are the engine's; without it the other transports still run, uncompressed
    from . import _native as kernels
except ImportError:
    kernels = None

FORMATS = ("bf16", "fp8")
_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM)
_DATA = (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16)
_REDUCING = (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.REDUCE_SCATTER_V)


# ---- the decision -----------------------------------------------------------------------------
def check(c, label: str, fmt, desc: OpDesc) -> None:
    """Refuse, with InvalidArgument, what no compressed form exists for; without the native
    engine (the extension not built) there is no compressed form at all: TransportUnavailable."""
    s = c.session
    if kernels is None:
        raise TransportUnavailable(f"compress={fmt!r} needs the native engine, which was not built",
                                   rank=s.rank, op=label)
    if fmt not in FORMATS:
        raise s.invalid(label, f"unknown compress format {fmt!r}: use None (exact), {', '.join(map(repr, FORMATS))}")
    if desc.kind in _REDUCING and desc.op not in _OPS:
        raise s.invalid(label, f"compress={fmt!r} sums in float32: {desc.op.name} is not allowed "
                               "(use SUM, AVG or PREMUL_SUM, or compress=None)")
    if desc.dtype not in _DATA:
        raise s.invalid(label, f"compress={fmt!r} needs floating-point data, got {desc.dtype.name.lower()}")
    for buf in (desc.send, desc.recv):
        if buf is not None and buf.device != "cpu":
            raise s.invalid(label, f"compress={fmt!r} runs on CPU buffers; this one is on {buf.device}")


def _why_exact(c, fmt: str, dtype: DType, nbytes: int) -> str | None:
    """Why the exact path runs instead (None: compress)."""
    if dtype.itemsize <= 2 and fmt == "bf16":
        return f"{dtype.name.lower()} data is no wider than the bf16 wire"
    if c.size == 1:
        return "a group of one rank"
    mode = config.get("COMM_COMPRESS")
    if mode in ("off", "force"):
        return "COMM_COMPRESS=off" if mode == "off" else None
    if c.topology.num_hosts == 1:
        return "one host: shared memory is not the bound"
    least = config.get("COMM_COMPRESS_MIN_BYTES")
    if nbytes < least:
        return f"{nbytes} bytes < COMM_COMPRESS_MIN_BYTES={least}"
    return None


def path(c, fmt: str, nbytes: int, dtype: DType = DType.FLOAT32, label: str = "all_reduce") -> str:
    """The path a call `label` with compress=fmt on `c` takes for a message of nbytes (also the
    bench's column): "compressed ...", "exact (... not chosen: why)", or "measuring" while the
    first calls of a size time both paths (COMM_COMPRESS=auto)."""
    why = _why_exact(c, fmt, dtype, nbytes)
    if why is None and config.get("COMM_COMPRESS") == "auto":
        probe = _state(c).probes.get((label, fmt, nbytes.bit_length()))
        if probe is None or probe.faster is None:
            return f"measuring (compress={fmt}: the first {PROBE_CALLS} calls of this size time both paths)"
        if not probe.faster:
            why = f"measured slower here: {probe.times_ms()}"
    return f"exact (compress={fmt} not chosen: {why})" if why else f"compressed {fmt} ({_layout(c)})"


def _layout(c) -> str:
    """The engine's layout (twolevel_compress.cc: two levels where every host holds the same
    number of ranks, more than one), in words."""
    t = c.topology
    if t.num_hosts > 1 and t.local_size > 1 and len({len(ranks) for ranks in t.hosts}) == 1:
        where = f"two-level: exact inside {t.local_size}-rank hosts, compressed across {t.num_hosts} hosts"
    else:
        where = f"flat over {c.size} ranks"
    transport = c.session.transport
    return where if transport.compressed_wire else f"{where}, on a native communicator beside {transport.name}"


def run(c, desc: OpDesc, fmt, async_op: bool):
    """The compressed form of the validated `desc` on communicator `c`, or its exact path."""
    label = desc.kind.label
    check(c, label, fmt, desc)
    nbytes = max(b.nbytes for b in (desc.send, desc.recv) if b is not None)
    taken = path(c, fmt, nbytes, desc.dtype, label)
    if taken.startswith("measuring"):
        _probe(c, label, fmt, nbytes).step(c, desc, fmt)
        return _ran(c, label, async_op)
    log.algorithm(c.rank, c.session.ctx.group_name, label, taken)
    if not taken.startswith("compressed"):
        return c.session.post(desc, async_op)
    return _compressed(c, desc, fmt, async_op)


def _compressed(c, desc: OpDesc, fmt: str, async_op: bool = False):
    """Runs desc compressed in the engine: posted (a real Work with async_op for float32 data)
    where the transport is the engine; else on the sibling (see _sibling), on this thread."""
    s, label = c.session, desc.kind.label
    block = config.get("COMM_COMPRESS_BLOCK")
    if s.transport.compressed_wire:
        if desc.dtype is DType.FLOAT32:
            return s.post(replace(desc, wire=fmt, wire_block=block), async_op)
        _converted(s, desc, fmt, block)
        return _ran(c, label, async_op)
    s.usable(label)
    # The parent's lock held across the sibling's call: one collective at a time on c, as if
    # it ran there; the sibling's failure is the parent's (later calls refuse, as after any).
    if not s.busy.acquire(False):
        raise s.overlap(label)
    try:
        sibling = _sibling(c, label).session
        if desc.dtype is DType.FLOAT32:
            sibling.post(replace(desc, wire=fmt, wire_block=block), False)
        else:
            _converted(sibling, desc, fmt, block)
    except CommError as e:
        raise s.failed(label, e) from None
    except BaseException as e:   # Ctrl-C: abort c too, so its peers fail instead of waiting
        s.interrupted(e, None)
        raise
    finally:
        s.busy.release()
    return _ran(c, label, async_op)


def _converted(s, desc: OpDesc, fmt: str, block: int) -> None:
    """float64 / float16 / bfloat16 data, posted blocking on session `s` as float32 workspaces
    (the engine compresses float32 only), converted back into the caller's output. PREMUL_SUM's
    factor is applied on the way in; the engine applies AVG's."""
    label, mine = desc.kind.label, desc.count
    whole = sum(desc.recv_counts) if desc.recv_counts is not None else s.size * mine
    sizes = {OpKind.ALL_REDUCE: (mine, mine), OpKind.REDUCE_SCATTER: (whole, mine),
             OpKind.REDUCE_SCATTER_V: (whole, mine)}.get(desc.kind, (mine, whole))   # else: gathers
    src, dst = np.empty(sizes[0], np.float32), np.empty(sizes[1], np.float32)
    src[:] = _as_float32(desc.send.numpy()[:sizes[0]], desc.dtype)
    if desc.kind in _REDUCING and desc.op is ReduceOp.PREMUL_SUM and desc.scale != 1.0:
        src *= np.float32(desc.scale)
    op = ReduceOp.AVG if desc.op is ReduceOp.AVG else ReduceOp.SUM
    s.post(replace(desc, send=as_buffer(src, op=label, writable=True), recv=as_buffer(dst, op=label, writable=True),
                   dtype=DType.FLOAT32, op=op, scale=1.0, wire=fmt, wire_block=block), False)
    out = desc.recv.numpy()
    if desc.dtype is DType.BFLOAT16:   # round to nearest even, as the engine's bf16 results
        packed = np.empty(dst.size, np.uint16)
        kernels.compress_to_bf16(dst.ctypes.data, packed.ctypes.data, dst.size)
        out[:dst.size] = packed
    else:
        out[:dst.size] = dst


def _as_float32(data: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.BFLOAT16:   # the caller's bfloat16 as numpy: its uint16 storage
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32, copy=False)


# ---- per communicator: the measurements, the sibling ------------------------------------------
class _State:
    def __init__(self):
        self.probes: dict[tuple[str, str, int], _Probe] = {}
        self.sibling = None   # the native Communicator of a transport that does not compress


# Kept here, by communicator, not as attributes set on it (no module writes another's object);
# weak keys: a communicator dropped without close() takes its state, and its sibling, along.
_STATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def _state(c) -> _State:
    with _STATES_LOCK:
        state = _STATES.get(c)
        if state is None:
            state = _STATES[c] = _State()
        return state


def _sibling(c, label: str):
    """The native communicator beside `c`: the same ranks in the same order, bootstrapped on
    the first compressed call through c's store (its view "compress"), as split bootstraps a
    group: every rank makes the same compressed calls, so every rank comes here together.
    Closed with c (close)."""
    state = _state(c)
    if state.sibling is None:
        from transports import base   # lazily, as the communicator: transports import comm's layers
        s = c.session
        ctx = s.child_context(tuple(range(s.size)), "compress", f"{s.ctx.group_name}/compress")
        log.debug(s.rank, f"{ctx.group_name}: {label} compressed: a native communicator beside {s.transport.name}")
        try:
            native = base.get("native").create(ctx)
        except OSError as e:   # no descriptors, no memory: a failure of set-up like the rest
            raise from_os_error(e, rank=s.rank, op=label) from None
        state.sibling = type(c)(native, ctx)   # a Communicator (comm.communicator imports this module)
    return state.sibling


def close(c) -> None:
    """Close the sibling of `c`'s compressed calls, if any (Communicator.close calls it)."""
    with _STATES_LOCK:
        state = _STATES.pop(c, None)
    if state is not None and state.sibling is not None:
        state.sibling.close()


# COMM_COMPRESS=auto measures, per communicator, operation, format and power-of-two size, the
# first calls: compressed (warm-up: the sibling, workspaces), exact, compressed, exact,
# compressed; the faster path by the slowest rank's best time of each (one 16-byte all_reduce)
# runs from then on. A link fast enough that compression only costs keeps the exact path, and
# so does a near tie (compressed must win by _MARGIN: a few timings on a busy machine are noisy,
# and a loss would cost accuracy for nothing).
PROBE_CALLS = 5
_MARGIN = 0.9


def _probe(c, label: str, fmt: str, nbytes: int) -> "_Probe":
    return _state(c).probes.setdefault((label, fmt, nbytes.bit_length()), _Probe())


class _Probe:
    def __init__(self):
        self.times: list[tuple[bool, float]] = []   # (compressed, seconds) of each probe call
        self.faster: bool | None = None             # compressed is faster (None: not known yet)
        self.best = (0.0, 0.0)                      # (exact, compressed) seconds, slowest rank

    def times_ms(self) -> str:
        return f"exact {self.best[0] * 1e3:.2f} ms, compressed {self.best[1] * 1e3:.2f} ms"

    def step(self, c, desc: OpDesc, fmt: str) -> None:
        compressed = len(self.times) % 2 == 0
        # Timed from a barrier: not the asynchronous calls still queued before this one (the
        # DDP hook's earlier buckets), nor another rank's late arrival (backward's skew).
        c.barrier()
        t0 = time.perf_counter()
        if compressed:
            _compressed(c, desc, fmt)
        else:
            c.session.post(desc, False)
        self.times.append((compressed, time.perf_counter() - t0))
        if len(self.times) < PROBE_CALLS:
            return
        best = np.array([min(t for comp, t in self.times[1:] if comp is want) for want in (False, True)])
        c.all_reduce(best, op=ReduceOp.MAX)
        self.best, self.faster = (float(best[0]), float(best[1])), bool(best[1] < _MARGIN * best[0])
        log.debug(c.rank, f"{c.session.ctx.group_name}: {desc.kind.label} of 2^{desc_bits(desc)} bytes with "
                          f"compress={fmt}: {self.times_ms()}: {'compressed' if self.faster else 'exact'} from now on")


def desc_bits(desc: OpDesc) -> int:
    return max(b.nbytes for b in (desc.send, desc.recv) if b is not None).bit_length() - 1


class _Ran:
    """The request of a compressed call that ran on the caller's thread before Work was made."""

    def wait(self, timeout=None) -> None:
        return None

    def test(self) -> bool:
        return True


def _ran(c, label: str, async_op: bool):
    return Work(c.session, _Ran(), label, None) if async_op else None


class Persistent:
    """all_reduce_init(..., compress=fmt) and the like: the arguments checked once, each start
    runs the compressed call (on the caller's thread: start() runs it, wait() returns)."""

    def __init__(self, c, desc: OpDesc, fmt):
        check(c, desc.kind.label + "_init", fmt, desc)
        self._comm, self._desc, self._fmt, self._work = c, desc, fmt, None

    def __call__(self) -> None:
        self.start()
        self.wait()

    def start(self) -> None:
        if self._desc is None:
            raise self._comm.session.invalid(self._desc_label(), "the persistent operation is closed")
        if self._work is not None:
            raise self._comm.session.invalid(self._desc_label(), "already started: wait() before starting it again")
        self._work = run(self._comm, self._desc, self._fmt, True)

    def wait(self, timeout: float | None = None) -> None:
        if self._work is None:
            raise self._comm.session.invalid(self._desc_label(), "wait() without a start()")
        work, self._work = self._work, None
        work.wait(timeout)

    def close(self) -> None:
        self._work = None
        self._desc = None

    def _desc_label(self) -> str:
        return "compressed persistent operation" if self._desc is None else self._desc.kind.label

    def __enter__(self) -> "Persistent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
