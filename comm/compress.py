"""Compressed collectives: fewer bits on the wire between hosts, sums kept in fp32.

    world.all_reduce(grad, compress="bf16")     # or "fp8"; likewise reduce_scatter,
                                                # all_gather, their v forms and *_init

A layer above the transports, built from the communicator's own collectives, so it runs on
every transport. Formats: "bf16" (float32 / float64 data sent as bfloat16, rounded to
nearest even) and "fp8" (e4m3 codes with one float32 scale per block of COMM_COMPRESS_BLOCK
elements; see native/src/compress.h). Every partial sum is kept in float32 by the receiver.

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
calls of that size measured it faster than the exact path (see PROBE_CALLS); COMM_COMPRESS=on skips
the measurement, force compresses always (one host too: tests), off never. Where the wire is as wide as the data (bfloat16 or float16 data with
"bf16") the exact path runs. COMM_DEBUG=1 logs the path each (op, format) first takes.

The calls run on the caller's thread; with async_op=True the returned Work is complete.
"""
from __future__ import annotations

import math
import threading
import time

import numpy as np

from . import config, log
from .errors import CommError, TransportUnavailable
from .ops import OpDesc, OpKind
from .types import DType, ReduceOp
from .work import Work

try:   # the kernels are the engine's; without it the other transports still run, uncompressed
    from . import _native
except ImportError:
    _native = None

FORMATS = ("bf16", "fp8")
_OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM)
_DATA = (DType.FLOAT32, DType.FLOAT64, DType.FLOAT16, DType.BFLOAT16)
# A large all_reduce runs in segments of about this many bytes (at most _SEGMENTS of
# them), so the shared-memory phases of one overlap the link-bound phase of another: serial,
# they cost a quarter of a 2 Gbit/s link's time on two cores.
_SEGMENT_BYTES = 8 << 20
_SEGMENTS = 8
_KINDS = (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.ALL_GATHER_V,
          OpKind.REDUCE_SCATTER_V)


# ---- wire formats -----------------------------------------------------------------------------
class _Bf16:
    name = "bf16"

    def __init__(self, block: int):
        self.unit = 64   # chunk lengths are multiples of this (alignment only)

    def wire(self, n: int) -> int:
        return 2 * n

    def encode(self, src: np.ndarray, dst: np.ndarray) -> None:
        _native.compress_to_bf16(src.ctypes.data, dst.ctypes.data, src.size)

    def add(self, acc: np.ndarray, src: np.ndarray, accumulate: bool) -> None:
        _native.compress_bf16_add(acc.ctypes.data, src.ctypes.data, acc.size, accumulate)


class _Fp8:
    """A packet of n elements: n code bytes, then one float32 scale per block."""
    name = "fp8"

    def __init__(self, block: int):
        self.block = block
        self.unit = math.lcm(block, 64)   # whole blocks per chunk, and scales 4-byte aligned

    def wire(self, n: int) -> int:
        return n + 4 * (n // self.block)

    def encode(self, src: np.ndarray, dst: np.ndarray) -> None:
        n = src.size
        _native.compress_to_fp8(src.ctypes.data, dst.ctypes.data, dst.ctypes.data + n, n, self.block)

    def add(self, acc: np.ndarray, src: np.ndarray, accumulate: bool) -> None:
        n = acc.size
        _native.compress_fp8_add(acc.ctypes.data, src.ctypes.data, src.ctypes.data + n, n, self.block,
                                 accumulate)


_FORMAT_CLASSES = {"bf16": _Bf16, "fp8": _Fp8}


# ---- the decision -----------------------------------------------------------------------------
def check(c, label: str, fmt, desc: OpDesc) -> None:
    """Refuse, with InvalidArgument, what no compressed form exists for."""
    if _native is None:
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
    if _two_level(t):
        return f"two-level: exact inside {t.local_size}-rank hosts, compressed across {t.num_hosts} hosts"
    return f"flat over {c.size} ranks"


def _two_level(t) -> bool:
    return t.num_hosts > 1 and len({len(ranks) for ranks in t.hosts}) == 1 and t.local_size > 1


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
    _compressed(c, desc, fmt)
    return Work(c, _Ran(), label, None) if async_op else None


def _compressed(c, desc: OpDesc, fmt: str) -> None:
    label = desc.kind.label
    if c._failure is not None or c._closed:
        c._refuse(label)
    if not c._busy.acquire(False):
        raise c._overlap(label)
    try:
        _plan(c).run(desc, _FORMAT_CLASSES[fmt](config.get("COMM_COMPRESS_BLOCK")))
    except CommError as e:
        raise c._failed_op(label, e) from None
    finally:
        c._busy.release()


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


# ---- the plan: sub-communicators and the three phases -------------------------------------------
def _plan(c) -> "_Plan":
    plan = getattr(c, "_compress_plan", None)
    if plan is None:
        plan = _Plan(c)
        c._compress_plan = plan
    return plan


def close(c) -> None:
    """Release the sub-communicators of `c`'s compressed calls (Communicator.close calls it)."""
    plan = getattr(c, "_compress_plan", None)
    if plan is not None:
        plan.close()


class _Plan:
    """The sub-communicators of one communicator's compressed calls, and their workspaces."""

    def __init__(self, c):
        t = c.topology
        self.c = c
        self.two_level = _two_level(t)
        # split runs on c, whose _busy this thread holds: _split is split without the lock
        # Flat: two communicators for the compressed phase (lanes); segments of a large
        # all_reduce alternate between them on two threads, so one lane's quantizing overlaps
        # the other's transfer (a communicator runs one collective at a time, on one thread).
        # Two-level: one lane, whose transfer the shared-memory phases overlap (a second lane
        # measured no faster with two ranks per host on two cores).
        if self.two_level:
            self.local = c._split(t.host, t.local_rank)
            self.lanes = [c._split(t.local_rank, t.host)]
            # rank of (host h, local position l) in c: the order of the two-level layouts
            self.order = [t.hosts[h][l] for l in range(t.local_size) for h in range(t.num_hosts)]
        else:
            self.local = None
            self.lanes = [c._split(0, c.rank) for _ in range(2)]
            self.order = list(range(c.size))
        self.cross = self.lanes[0]
        self._space: dict[str, np.ndarray] = {}

    def close(self) -> None:
        for sub in [self.local] + self.lanes:
            if sub is not None:
                sub.close()
        self._space.clear()

    def space(self, name: str, n: int, dtype) -> np.ndarray:
        """A reused workspace of n elements (grown as needed; calls on one communicator are
        serial, so one of each kind suffices)."""
        dtype = np.dtype(dtype)
        buf = self._space.get(name)
        if buf is None or buf.nbytes < n * dtype.itemsize:
            buf = self._space[name] = np.empty(max(n * dtype.itemsize, 64), np.uint8)
        return buf[:n * dtype.itemsize].view(dtype)

    # ---- entry ------------------------------------------------------------------------------
    def run(self, desc: OpDesc, f) -> None:
        kind, n = desc.kind, self.c.size
        if kind is OpKind.ALL_REDUCE:
            self.all_reduce(desc, f)
            return
        counts = desc.recv_counts if kind in (OpKind.ALL_GATHER_V, OpKind.REDUCE_SCATTER_V) else (desc.count,) * n
        most = max(counts) if counts else 0
        # flat: segments over the lanes, as all_reduce (each rank's block cut in `segments`)
        segments = 1 if self.two_level else max(1, min(_SEGMENTS, n * most * 4 // _SEGMENT_BYTES))
        block = _round_up(most, f.unit * segments)
        if kind in (OpKind.ALL_GATHER, OpKind.ALL_GATHER_V):
            self.all_gather(desc, counts, block, segments, f)
        else:
            self.reduce_scatter(desc, counts, block, segments, f)

    def all_reduce(self, desc: OpDesc, f) -> None:
        count = desc.count
        local = self.local.size if self.two_level else 1
        hosts = self.cross.size
        # segments of the two-level form, pipelined (see _pipelined); one where there is no
        # shared-memory phase to hide, or the message is small
        segments = max(1, min(_SEGMENTS, count * 4 // _SEGMENT_BYTES))
        chunk = _round_up(-(-count // (local * hosts * segments)), f.unit)
        total = chunk * local * hosts * segments
        if desc.dtype is DType.FLOAT32 and count == total:
            # float32 without padding: the output is the workspace (no copy in, none out)
            work = desc.recv.numpy()
            if desc.send.ptr != desc.recv.ptr:
                work[:] = desc.send.numpy()
            if desc.op is ReduceOp.PREMUL_SUM and desc.scale != 1.0:
                work *= np.float32(desc.scale)
        else:
            work = self.space("work", total, np.float32)
            _load(work, desc.send, 0, count, desc)
        self._pipelined(work, chunk, segments, f)
        _store(desc.recv, work[:count], desc, self.c.size)

    def _pipelined(self, work: np.ndarray, chunk: int, segments: int, f) -> None:
        """The all_reduce of `segments` equal segments of work. Two-level: this thread runs the
        `local` communicator's calls (reduce_scatter of segment k + 1, then all_gather of
        segment k: the same order on every rank) while the lanes' threads run the compressed
        phase of the segments in between, so the shared-memory phases overlap the link-bound
        one. Flat: the lanes' threads alone. Each communicator stays on one thread."""
        local = self.local.size if self.two_level else 1
        hosts = self.cross.size
        seg, part = chunk * local * hosts, chunk * hosts
        shards = self.space("shard", part * segments, np.float32) if local > 1 else work
        for lane in range(len(self.lanes)):   # made here: the lanes' threads only use them
            for name in ("send", "recv", "gathered"):
                self.space(f"{name}{lane}", f.wire(chunk) * hosts, np.uint8)
            self.space(f"packet{lane}", f.wire(chunk), np.uint8)
        ready = [threading.Event() for _ in range(segments)]
        summed = [threading.Event() for _ in range(segments)]
        failure: list[BaseException] = []

        def across(lane: int):
            try:
                for k in range(lane, segments, lanes):
                    ready[k].wait()
                    if failure:
                        return
                    self.cross_all_reduce(shards[k * part:(k + 1) * part], chunk, f, lane)
                    summed[k].set()
            except BaseException as e:
                failure.append(e)
                for event in summed:   # nobody waits for a segment that will not come
                    event.set()

        lanes = min(len(self.lanes), segments)
        helpers = [threading.Thread(target=across, args=(lane,), name=f"comm-compress-{lane}", daemon=True)
                   for lane in range(lanes)]
        for helper in helpers:
            helper.start()
        try:
            if local == 1:   # nothing to do first: every segment is ready
                for event in ready:
                    event.set()
            else:
                self.local.reduce_scatter(shards[:part], work[:seg])
                ready[0].set()
                for k in range(segments):
                    if k + 1 < segments:
                        self.local.reduce_scatter(shards[(k + 1) * part:(k + 2) * part],
                                                  work[(k + 1) * seg:(k + 2) * seg])
                        ready[k + 1].set()
                    summed[k].wait()
                    if failure:
                        break
                    self.local.all_gather(work[k * seg:(k + 1) * seg], shards[k * part:(k + 1) * part])
        except BaseException as e:
            failure.append(e)
            for event in ready:
                event.set()
        for helper in helpers:
            helper.join()
        if failure:
            raise failure[0]

    def reduce_scatter(self, desc: OpDesc, counts, block: int, segments: int, f) -> None:
        """Block d of the input (counts[d] elements) summed over ranks lands on rank d."""
        n = self.c.size
        plain = _plain(desc, counts, block)
        if plain and not self.two_level and desc.op is not ReduceOp.PREMUL_SUM:
            work = desc.send.numpy()   # only read: no copy
        else:
            work = self.space("work", block * n, np.float32)
            starts = np.cumsum((0,) + tuple(counts))
            for slot, rank in enumerate(self.order):   # the two-level layout: [local pos][host]
                _load(work[slot * block:(slot + 1) * block], desc.send, starts[rank], counts[rank], desc)
        hosts = self.cross.size
        part = work
        if self.two_level:
            part = self.space("shard", block * hosts, np.float32)
            self.local.reduce_scatter(part, work)
        # the sum is made in the output where it is plain float32 (in place too: this rank's
        # block of the input is read last)
        mine = desc.recv.numpy() if plain else self.space("mine", block, np.float32)
        rows, seg = part.reshape(hosts, block), block // segments
        self.in_lanes(segments, lambda k, lane: self.cross_reduce_scatter(
            rows[:, k * seg:(k + 1) * seg], mine[k * seg:(k + 1) * seg], f, lane))
        _store(desc.recv, mine[:counts[self.c.rank]], desc, n)

    def all_gather(self, desc: OpDesc, counts, block: int, segments: int, f) -> None:
        n = self.c.size
        plain = _plain(desc, counts, block) and not self.two_level
        if plain:   # float32 without padding, in rank order: read the input, write the output
            mine = desc.send.numpy()
        else:
            mine = self.space("mine", block, np.float32)
            _load(mine, desc.send, 0, counts[self.c.rank], desc)
        hosts = self.cross.size
        gathered = desc.recv.numpy() if plain else self.space("shard", block * hosts, np.float32)
        rows, seg = gathered.reshape(hosts, block), block // segments
        self.in_lanes(segments, lambda k, lane: self.cross_all_gather(
            mine[k * seg:(k + 1) * seg], rows[:, k * seg:(k + 1) * seg], f, lane))
        if plain:
            return
        work = gathered
        if self.two_level:
            work = self.space("work", block * n, np.float32)
            self.local.all_gather(work, gathered)
        out = desc.recv.numpy()
        starts = np.cumsum((0,) + tuple(counts))
        for slot, rank in enumerate(self.order):
            _store_into(out, starts[rank], work[slot * block:slot * block + counts[rank]], desc.dtype)

    # ---- the compressed phases, among `cross` (one rank per host, or every rank) ------------
    def cross_all_reduce(self, shard: np.ndarray, chunk: int, f, lane: int = 0) -> None:
        """shard (hosts x chunk) summed over a lane, in place: each element quantized twice."""
        cross = self.lanes[lane]
        if cross.size == 1:
            return
        rows = shard.reshape(cross.size, chunk)
        mine = rows[cross.rank]
        self.cross_reduce_scatter(rows, mine, f, lane)   # mine: own data + the others' sums
        self.cross_all_gather(mine, rows, f, lane)       # every rank dequantizes the same bytes

    def cross_reduce_scatter(self, rows: np.ndarray, out: np.ndarray, f, lane: int = 0) -> None:
        """out = sum over a lane of row `rank` of rows (one row per rank, each contiguous; the
        whole need not be); the own row is added exactly, the others quantized once."""
        cross = self.lanes[lane]
        hosts, me, chunk = cross.size, cross.rank, rows.shape[1]
        if out.ctypes.data != rows[me].ctypes.data:
            out[:] = rows[me]
        if hosts == 1:
            return
        w = f.wire(chunk)
        send = self.space(f"send{lane}", w * hosts, np.uint8)
        for j in range(hosts):
            if j != me:
                f.encode(rows[j], send[j * w:(j + 1) * w])
        recv = self.space(f"recv{lane}", w * hosts, np.uint8)
        cross.all_to_all(recv, send)
        for j in range(hosts):
            if j != me:
                f.add(out, recv[j * w:(j + 1) * w], True)

    def cross_all_gather(self, mine: np.ndarray, rows: np.ndarray, f, lane: int = 0) -> None:
        """Row r of rows = rank r's mine, quantized once (this rank's row too: same bits everywhere)."""
        cross = self.lanes[lane]
        w = f.wire(mine.size)
        packet = self.space(f"packet{lane}", w, np.uint8)
        f.encode(mine, packet)
        gathered = self.space(f"gathered{lane}", w * cross.size, np.uint8)
        cross.all_gather(gathered, packet)
        for j in range(cross.size):
            f.add(rows[j], gathered[j * w:(j + 1) * w], False)

    def in_lanes(self, segments: int, body) -> None:
        """body(k, lane) for k in range(segments), segment k on lane k % lanes, each lane on a
        thread of its own (inline when there is one segment)."""
        if segments == 1:
            body(0, 0)
            return
        failure: list[BaseException] = []

        def lane_loop(lane: int):
            try:
                for k in range(lane, segments, len(self.lanes)):
                    if failure:
                        return
                    body(k, lane)
            except BaseException as e:
                failure.append(e)

        threads = [threading.Thread(target=lane_loop, args=(lane,), name=f"comm-compress-{lane}", daemon=True)
                   for lane in range(min(len(self.lanes), segments))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failure:
            raise failure[0]


# ---- data in and out ------------------------------------------------------------------------
def _plain(desc: OpDesc, counts, block: int) -> bool:
    """float32 blocks that need no padding: the caller's buffers serve as workspaces."""
    return desc.dtype is DType.FLOAT32 and all(k == block for k in counts)


def _round_up(n: int, unit: int) -> int:
    return max(unit, -(-n // unit) * unit)


def _as_f32(buf_np: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.BFLOAT16:
        return (buf_np.astype(np.uint32) << 16).view(np.float32)
    return buf_np.astype(np.float32, copy=False)


def _load(dst: np.ndarray, src, start: int, count: int, desc: OpDesc) -> None:
    """dst[:count] = float32 of src's elements [start, start + count), premultiplied for
    PREMUL_SUM; the rest of dst (padding) zero."""
    data = src.numpy()[start:start + count]
    dst[:count] = _as_f32(data, desc.dtype)
    dst[count:] = 0
    if desc.kind in (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.REDUCE_SCATTER_V) \
            and desc.op is ReduceOp.PREMUL_SUM and desc.scale != 1.0:
        dst[:count] *= np.float32(desc.scale)


def _store(recv, result: np.ndarray, desc: OpDesc, size: int) -> None:
    if desc.op is ReduceOp.AVG:
        result *= np.float32(1.0 / size)
    _store_into(recv.numpy(), 0, result, desc.dtype)


def _store_into(out: np.ndarray, start: int, values: np.ndarray, dtype: DType) -> None:
    if dtype is DType.BFLOAT16:   # round to nearest even, as the engine's bf16 results
        packed = np.empty(values.size, np.uint16)
        _native.compress_to_bf16(np.ascontiguousarray(values).ctypes.data, packed.ctypes.data, values.size)
        out[start:start + values.size] = packed
    elif values.size and out[start:].ctypes.data != values.ctypes.data:   # else: computed in place
        out[start:start + values.size] = values
