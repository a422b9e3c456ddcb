"""The algorithm of compressed collectives (comm.compress): the wire formats, the
sub-communicators of one communicator's compressed calls, and the phases built from their
collectives (see comm/compress.py for the whole picture). Nothing here decides whether to
compress; comm.compress does, and calls Plan.run. A transport that compresses itself
(Transport.compressed_wire: the native engine) never reaches the plan: every compressed
collective runs in its engine.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from .compress_data import kernels, load_float32, store_float32
from .core.ops import OpDesc, OpKind
from .core.types import DType, ReduceOp

# A large all_reduce (and a flat reduce_scatter / all_gather) runs in segments of about this
# many bytes (at most _SEGMENTS of them), so the shared-memory phases of one overlap the
# link-bound phase of another, and one lane's quantizing the other's transfer: serial, they
# cost a quarter of a 2 Gbit/s link's time on two cores.
_SEGMENT_BYTES = 8 << 20
_SEGMENTS = 8


# ---- wire formats -----------------------------------------------------------------------------
class _Bf16:
    name = "bf16"

    def __init__(self, block: int):
        self.unit = 64   # chunk lengths are multiples of this (alignment only)

    def wire(self, n: int) -> int:
        return 2 * n

    def encode(self, src: np.ndarray, dst: np.ndarray) -> None:
        kernels.compress_to_bf16(src.ctypes.data, dst.ctypes.data, src.size)

    def add(self, acc: np.ndarray, src: np.ndarray, accumulate: bool) -> None:
        kernels.compress_bf16_add(acc.ctypes.data, src.ctypes.data, acc.size, accumulate)


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
        kernels.compress_to_fp8(src.ctypes.data, dst.ctypes.data, dst.ctypes.data + n, n, self.block)

    def add(self, acc: np.ndarray, src: np.ndarray, accumulate: bool) -> None:
        n = acc.size
        kernels.compress_fp8_add(acc.ctypes.data, src.ctypes.data, src.ctypes.data + n, n, self.block,
                                 accumulate)


FORMAT_CLASSES = {"bf16": _Bf16, "fp8": _Fp8}


def two_level(t) -> bool:
    return t.num_hosts > 1 and len({len(ranks) for ranks in t.hosts}) == 1 and t.local_size > 1


class Plan:
    """The sub-communicators of one communicator's compressed calls, and their workspaces."""

    def __init__(self, c):
        t = c.topology
        self.c = c
        self.two_level = two_level(t)
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
            load_float32(work, desc.send, 0, count, desc)
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
                load_float32(work[slot * block:(slot + 1) * block], desc.send, starts[rank], counts[rank], desc)
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
            load_float32(mine, desc.send, 0, counts[self.c.rank], desc)
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
            store_float32(out, starts[rank], work[slot * block:slot * block + counts[rank]], desc.dtype)

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


def _store(recv, result: np.ndarray, desc: OpDesc, size: int) -> None:
    if desc.op is ReduceOp.AVG:
        result *= np.float32(1.0 / size)
    store_float32(recv.numpy(), 0, result, desc.dtype)
