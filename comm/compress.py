"""Compressed collectives: fewer bits on the wire between hosts, sums kept in fp32.

    world.all_reduce(grad, compress="bf16")     # or "fp8"; likewise reduce_scatter,
                                                # all_gather, their v forms and *_init

A layer above the transports. On the native engine (and its UCX / verbs channels) every
compressed collective (all_reduce, reduce_scatter, all_gather, the v forms) runs inside the
engine (native/src/algorithms/twolevel_compress.cc: the same algorithm, its network phase encoding and
decode-adding on the engine's thread, pipelined with the shared-memory phases; async_op=True
returns a Work that completes later for float32 data; other floats are converted around it);
on other transports (mpi) they are built from the communicator's own collectives
(comm/compress_plan.py), so they run on every transport. Formats: "bf16" (float32 / float64
data sent as bfloat16, rounded to nearest even) and "fp8" (e4m3 codes with one float32 scale
per block of COMM_COMPRESS_BLOCK elements; see native/src/kernels/compress.h). Every partial sum is
kept in float32 by the receiver.

The algorithm (torchft's quantize - exchange - reduce - requantize, over the topology):

    all_reduce      exact reduce_scatter inside each host (shared memory, float32)
                    -> among the ranks of the same local position on every host: quantize
                       each host's chunk, all_to_all, dequantize-and-add in float32,
                       quantize the sum, all_gather, dequantize
                    -> exact all_gather inside each host
    reduce_scatter  exact reduce_scatter inside each host, then the compressed flat
                    reduce_scatter (quantize, all_to_all, dequantize-and-add) across hosts
    all_gather      compressed all_gather across hosts (quantize once, dequantize on
                    arrival), then the exact all_gather inside each host

so every element is quantized at most twice whatever the number of ranks and hosts. The
sub-communicators (ranks of one host; ranks of one local position) are made by split on the
first compressed call that runs this way and kept: every rank makes the same calls, as for
any collective. Hosts with unequal rank counts, or one host with COMM_COMPRESS=force, run
the flat form over all ranks.

When it is chosen (else the exact path runs, unchanged): the communicator spans hosts, the
message holds at least COMM_COMPRESS_MIN_BYTES, and (COMM_COMPRESS=auto, the default) the first
calls of that size measured it faster than the exact path (see PROBE_CALLS); COMM_COMPRESS=on
skips the measurement, force compresses always (one host too: tests), off never. Where the
wire is as wide as the data (bfloat16 or float16 data with "bf16") the exact path runs.
COMM_DEBUG=1 logs the path each (op, format) first takes, and each measured choice.
The algorithm itself lives in comm/compress_plan.py.

The plan's calls (and the engine's converted ones) run on the caller's thread; with
async_op=True the returned Work is complete.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from .core import config, log
from .core.errors import CommError, TransportUnavailable
from .compress_data import kernels, load_float32, store_float32
from .compress_plan import FORMAT_CLASSES, Plan, two_level
from .core.ops import OpDesc, OpKind
from .core.types import DType, ReduceOp
from .work import Work

FORMATS = ("bf16", "fp8")
_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM)
_DATA = (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16)


# ---- the decision -----------------------------------------------------------------------------
def check(c, label: str, fmt, desc: OpDesc) -> None:
    """Refuse, with InvalidArgument, what no compressed form exists for."""
    if kernels is None:
        raise TransportUnavailable(f"compress={fmt!r} needs the native engine's kernels, which were not built",
                                   rank=c.rank, op=label)
    if fmt not in FORMATS:
        raise c._error(label, f"unknown compress format {fmt!r}: use None (exact), {', '.join(map(repr, FORMATS))}")
    if desc.kind in (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.REDUCE_SCATTER_V) and desc.op not in _OPS:
        raise c._error(label, f"compress={fmt!r} sums in float32: {desc.op.name} is not allowed "
                              "(use SUM, AVG or PREMUL_SUM, or compress=None)")
    if desc.dtype not in _DATA:
        raise c._error(label, f"compress={fmt!r} needs floating-point data, got {desc.dtype.name.lower()}")
    for buf in (desc.send, desc.recv):
        if buf is not None and buf.device != "cpu":
            raise c._error(label, f"compress={fmt!r} runs on CPU buffers; this one is on {buf.device}")


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
        probe = getattr(c, "_compress_probes", {}).get((label, fmt, nbytes.bit_length()))
        if probe is None or probe.faster is None:
            return f"measuring (compress={fmt}: the first {PROBE_CALLS} calls of this size time both paths)"
        if not probe.faster:
            why = f"measured slower here: {probe.times_ms()}"
    return f"exact (compress={fmt} not chosen: {why})" if why else f"compressed {fmt} ({_layout(c)})"


def _layout(c) -> str:
    t = c.topology
    if two_level(t):
        return f"two-level: exact inside {t.local_size}-rank hosts, compressed across {t.num_hosts} hosts"
    return f"flat over {c.size} ranks"


def run(c, desc: OpDesc, fmt, async_op: bool):
    """The compressed form of the validated `desc` on communicator `c`, or its exact path."""
    label = desc.kind.label
    check(c, label, fmt, desc)
    nbytes = max(b.nbytes for b in (desc.send, desc.recv) if b is not None)
    taken = path(c, fmt, nbytes, desc.dtype, label)
    if taken.startswith("measuring"):
        _probe(c, label, fmt, nbytes).step(c, desc, fmt)
        return Work(c, _Ran(), label, None) if async_op else None
    log.algorithm(c.rank, c._ctx.group_name, label, taken)
    if not taken.startswith("compressed"):
        return c._post(desc, async_op)
    return _compressed(c, desc, fmt, async_op)


# What the transport's engine runs compressed itself (Transport.compressed_wire).
_ENGINE_KINDS = (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.REDUCE_SCATTER_V,
                 OpKind.ALL_GATHER_V)


def _compressed(c, desc: OpDesc, fmt: str, async_op: bool = False):
    """Runs desc compressed: in the transport's engine where it has one (a real Work with
    async_op for float32 data), else the plan (comm/compress_plan.py) on this thread."""
    label = desc.kind.label
    block = config.get("COMM_COMPRESS_BLOCK")
    if desc.kind in _ENGINE_KINDS and c._transport.compressed_wire:
        if desc.dtype is DType.FLOAT32:
            return c._post(replace(desc, wire=fmt, wire_block=block), async_op)
        _engine_converted(c, desc, fmt, block)
        return Work(c, _Ran(), label, None) if async_op else None
    if c._failure is not None or c._closed:
        c._refuse(label)
    if not c._busy.acquire(False):
        raise c._overlap(label)
    try:
        _plan(c).run(desc, FORMAT_CLASSES[fmt](block))
    except CommError as e:
        raise c._failed_op(label, e) from None
    finally:
        c._busy.release()
    return Work(c, _Ran(), label, None) if async_op else None


# COMM_COMPRESS=auto measures, per communicator, operation, format and power-of-two size, the
# first calls: compressed (warm-up: sub-communicators, workspaces), exact, compressed, exact,
# compressed; the faster path by the slowest rank's best time of each (one 16-byte all_reduce)
# runs from then on. A link fast enough that compression only costs keeps the exact path, and
# so does a near tie (compressed must win by _MARGIN: a few timings on a busy machine are noisy,
# and a loss would cost accuracy for nothing).
PROBE_CALLS = 5
_MARGIN = 0.9


def _probe(c, label: str, fmt: str, nbytes: int) -> "_Probe":
    probes = c.__dict__.setdefault("_compress_probes", {})
    return probes.setdefault((label, fmt, nbytes.bit_length()), _Probe())


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
            c._post(desc, False)
        self.times.append((compressed, time.perf_counter() - t0))
        if len(self.times) < PROBE_CALLS:
            return
        best = np.array([min(t for comp, t in self.times[1:] if comp is want) for want in (False, True)])
        c.all_reduce(best, op=ReduceOp.MAX)
        self.best, self.faster = (float(best[0]), float(best[1])), bool(best[1] < _MARGIN * best[0])
        log.debug(c.rank, f"{c._ctx.group_name}: {desc.kind.label} of 2^{desc_bits(desc)} bytes with "
                          f"compress={fmt}: {self.times_ms()}: {'compressed' if self.faster else 'exact'} from now on")


def _engine_converted(c, desc: OpDesc, fmt: str, block: int) -> None:
    """float64 / float16 / bfloat16 data: converted to float32 workspaces (as the plan does:
    load_float32 applies PREMUL_SUM's factor, the engine AVG's), run in the engine, converted
    back."""
    label, mine = desc.kind.label, desc.count
    whole = sum(desc.recv_counts) if desc.recv_counts is not None else c.size * mine
    sizes = {OpKind.ALL_REDUCE: (mine, mine), OpKind.REDUCE_SCATTER: (whole, mine),
             OpKind.REDUCE_SCATTER_V: (whole, mine)}.get(desc.kind, (mine, whole))   # else: gathers
    src, dst = np.empty(sizes[0], np.float32), np.empty(sizes[1], np.float32)
    load_float32(src, desc.send, 0, sizes[0], desc)
    send = c._buf(src, label, writable=True, what="input")
    recv = c._buf(dst, label, writable=True, what="output")
    op = ReduceOp.AVG if desc.op is ReduceOp.AVG else ReduceOp.SUM
    c._post(replace(desc, send=send, recv=recv, dtype=DType.FLOAT32, op=op, scale=1.0, wire=fmt, wire_block=block),
            False)
    store_float32(desc.recv.numpy(), 0, dst, desc.dtype)


def desc_bits(desc: OpDesc) -> int:
    return max(b.nbytes for b in (desc.send, desc.recv) if b is not None).bit_length() - 1


class _Ran:
    """The request of a compressed call: it ran on the caller's thread before Work was made."""

    def wait(self, timeout=None) -> None:
        return None

    def test(self) -> bool:
        return True


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
            raise self._comm._error(self._desc_label(), "the persistent operation is closed")
        if self._work is not None:
            raise self._comm._error(self._desc_label(), "already started: wait() before starting it again")
        self._work = run(self._comm, self._desc, self._fmt, True)

    def wait(self, timeout: float | None = None) -> None:
        if self._work is None:
            raise self._comm._error(self._desc_label(), "wait() without a start()")
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


# ---- the plan (comm.compress_plan), made on first use ------------------------------------------
def _plan(c) -> Plan:
    plan = getattr(c, "_compress_plan", None)
    if plan is None:
        plan = Plan(c)
        c._compress_plan = plan
    return plan


def close(c) -> None:
    """Release the sub-communicators of `c`'s compressed calls (Communicator.close calls it)."""
    plan = getattr(c, "_compress_plan", None)
    if plan is not None:
        plan.close()
