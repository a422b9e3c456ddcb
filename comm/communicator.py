"""Communicator: validates every argument, builds one OpDesc, posts it to the transport.

The common call (a blocking all_reduce or broadcast of one plain array with a built-in op)
first tries the transport's lean path, where it has one: a single native call that checks
the array itself and builds no Python objects; anything it does not take comes back here
for the full checks. Nothing here knows a transport's details. Bad input is refused on the caller's rank with
InvalidArgument before anything is sent, and the communicator stays usable afterwards; a
transport failure (dead peer, timeout, mismatch, abort) poisons the communicator, so later
calls fail at once with the original cause instead of hanging.
"""
from __future__ import annotations

import collections
import itertools
import operator
import os
import struct
import threading
import weakref

import numpy as np

from .bootstrap import auth, limits, rendezvous
from .core import config, log
from . import elastic, vcollectives
from . import compress as compression
from .core.buffers import Buffer, as_buffer
from .core.errors import (Aborted, Closed, CommError, CommTimeout, InvalidArgument, PeerFailure,
                     Revoked, TransportUnavailable, _integer, _many, from_os_error)
from .flight_recorder import FlightRecorder
from .core.ops import DONE, LEAN_BUSY, BootstrapContext, OpDesc, OpKind
from .persistent import Persistent
from .bootstrap.topology import Topology
from .core.types import DType, PremulSum, ReduceOp, op_allowed
from .window import MAX_SIGNALS, Window
from .work import Work

try:   # the engine's lean calls take this lock natively (threading.Lock's acquire is a Python call)
    from ._native import BusyLock as _BusyLock
except ImportError:   # the extension was not built: the other transports still run
    _BusyLock = threading.Lock

SUM, PRODUCT, MIN, MAX, AVG = ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG
# (op, dtype) -> allowed, precomputed: enum construction and checks cost microseconds per call,
# and the Python layer's cost is most of a small message's latency.
_REDUCE_OPS = {op: op for op in ReduceOp}
_ALLOWED = {(op, dt): op_allowed(op, dt) for op in ReduceOp for dt in DType}
_ALL_REDUCE, _BROADCAST = int(OpKind.ALL_REDUCE), int(OpKind.BROADCAST)  # plain ints: no enum lookups
_ALL_GATHER, _REDUCE_SCATTER = int(OpKind.ALL_GATHER), int(OpKind.REDUCE_SCATTER)
_ALL_GATHER_V, _REDUCE_SCATTER_V = int(OpKind.ALL_GATHER_V), int(OpKind.REDUCE_SCATTER_V)
_ALL_TO_ALL = int(OpKind.ALL_TO_ALL)
_SKIPPED = object()   # _lean_call: the lean path did not take the call


class Communicator:
    """A group of ranks and the transport that connects them. Create with comm.init()."""

    def __init__(self, transport, ctx: BootstrapContext, *, owned_store=None,
                 ranks: tuple[int, ...] | None = None):
        self._transport = transport
        self._ctx = ctx
        self._owned_store = owned_store  # the world's store connection, closed with it
        self.rank = ctx.rank
        self.size = ctx.size
        self.timeout = ctx.timeout
        self.transport = transport.name
        # the job's numbering of the members (world ranks; comm.elastic gives newcomers the next)
        self.ranks = ranks if ranks is not None else tuple(range(ctx.size))
        self.epoch = 0   # shrink and grow number their communicators on from their parent's
        self._elastic_calls = 0   # agree / shrink / grow so far: names each one alike on every rank
        self._failed_ranks: list[int] = []
        self._next_seq = itertools.count(1).__next__   # atomic under the GIL
        self._split_count = 0
        self._failure: CommError | None = None
        self._closed = False
        self._pid = os.getpid()   # the owner: a forked child may not use it (see _disown)
        self._foreign = False
        self._busy = _BusyLock()  # held by the thread inside a collective
        _LIVE.add(self)
        self._recorder = FlightRecorder(ctx.rank, ctx.group_name, getattr(transport, "recent_ops", None))
        self._stager = None   # a comm.staging.Stager once a CUDA buffer meets a CPU-only transport
        self._lean = transport.run_array  # None: every call takes the full path
        self._lean_async = transport.post_array   # its async form
        # (request, OpDesc, recorder line) of Works dropped before their operation ended: the
        # transport may still read or write those buffers, so they are held here until the
        # operation is seen to end (_reap, at each post and at close). Appended by Work.__del__
        # (a deque: append and popleft are atomic, from any thread or a garbage collection).
        self._orphans: collections.deque = collections.deque()
        self._reap_every = self._reap_in = 1   # posts between looks at the orphans (see _reap)
        weakref.finalize(self, _ABANDONED.extend, self._orphans)
        self.topology = Topology.from_host_ids(ctx.host_ids or [ctx.host_id] * ctx.size, ctx.rank)
        log.debug(ctx.rank, f"{ctx.group_name}: topology {self.topology}")

    def __repr__(self) -> str:
        return f"<comm.Communicator rank {self.rank} of {self.size} on {self.transport} ({self._ctx.group_name})>"

    # ---- context manager -------------------------------------------------------------------
    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- argument checking -----------------------------------------------------------------
    def _error(self, op: str, cause: str) -> InvalidArgument:
        return InvalidArgument(cause, rank=self.rank, op=op)

    def _buf(self, x, op: str, *, writable: bool, what: str) -> Buffer:
        if x is None:
            raise self._error(op, f"{what} buffer is required")
        try:
            buf = as_buffer(x, op=op, writable=writable)
        except InvalidArgument as e:
            raise self._error(op, f"{what}: {e.cause}") from None
        if buf.device not in self._transport.devices:
            if buf.device == "cuda" and "cpu" in self._transport.devices:
                self._staging(op)   # CUDA data through pinned host memory (comm.staging)
                return buf
            raise self._error(op, f"{what} is on {buf.device}, which transport {self.transport!r} cannot "
                                  f"reach (it takes {', '.join(sorted(self._transport.devices))}); "
                                  "use a transport for that device (nccl for CUDA) or move the data")
        return buf

    def _staging(self, op: str):
        if self._stager is None:
            from .staging import Stager
            try:
                self._stager = Stager(self._transport.post, f"the {self.transport} transport")
            except CommError as e:
                raise self._error(op, f"CUDA buffer on the {self.transport} transport: {e.cause}") from None
        return self._stager

    def _apart(self, op: str, inner: Buffer, outer: Buffer, at: int | None, layout: str = "") -> None:
        """Refuse an input and output that share memory, except `inner` starting exactly at byte
        `at` of `outer` (the call's in-place layout, `layout` in words; None: there is none).
        Any other overlap lets a peer read what this rank is already overwriting (or the
        reverse): data silently wrong on some rank, so it is an error on this one."""
        if not inner.nbytes or not outer.nbytes or inner.device != outer.device:
            return
        if inner.ptr + inner.nbytes <= outer.ptr or outer.ptr + outer.nbytes <= inner.ptr:
            return
        if at is not None and inner.ptr == outer.ptr + at:
            return
        raise self._error(op, "input and output overlap" + (
            f" other than in place ({layout})" if at is not None else
            f"; {op} cannot run in place (peers read the input while the output is written): "
            "pass a separate output"))

    def _same_type(self, op: str, a: Buffer, b: Buffer) -> None:
        if a.dtype != b.dtype:
            raise self._error(op, f"mixed dtypes: input is {a.dtype.name.lower()}, output is {b.dtype.name.lower()}")
        if a.device != b.device:
            raise self._error(op, f"input is on {a.device}, output on {b.device}")

    def _reduce_op(self, op_name: str, op, buf: Buffer, scale: float | None) -> tuple[ReduceOp, float]:
        try:
            rop = _REDUCE_OPS.get(op) if type(op) is not PremulSum else None
        except TypeError:  # unhashable: certainly no op
            rop = None
        if rop is None:
            if type(op) is not PremulSum:
                raise self._error(op_name, f"unknown reduce op {op!r}")
            rop, factor = ReduceOp.PREMUL_SUM, op.factor
        else:
            factor = 1.0 if scale is None else float(scale)
            if rop is ReduceOp.PREMUL_SUM and scale is None:
                raise self._error(op_name, "PREMUL_SUM needs a factor: op=comm.premul_sum(f) or scale=f")
        if not _ALLOWED[rop, buf.dtype]:
            raise self._error(op_name, f"{rop.name} is not defined for {buf.dtype.name.lower()}")
        return rop, factor

    def _root(self, op: str, root: int, what: str = "root") -> int:
        try:
            rank = _integer(root)
        except TypeError:
            rank = None
        if rank is None or not 0 <= rank < self.size:
            raise self._error(op, f"{what} {root!r} is out of range for a group of {self.size}")
        return rank

    def _count_match(self, op: str, got: int, want: int, what: str) -> None:
        if got != want:
            raise self._error(op, f"{what} has {got} elements, expected {want}")

    # ---- posting -----------------------------------------------------------------------------
    def _post(self, desc: OpDesc, async_op: bool, via=None, exclusive: bool = True):
        """Post desc to the transport (or to `via`, a persistent op prepared from it).
        exclusive: a collective, which no other thread may be posting or running at the same
        time (point-to-point calls pass False: they match by peer and tag, not by order)."""
        if self._orphans:
            self._reap_soon()
        if self._failure is not None or self._closed:
            self._refuse(desc.kind.label)
        if exclusive and not self._busy.acquire(False):
            raise self._overlap(desc.kind.label)
        try:
            desc.seq = self._next_seq()
            entry = self._recorder.posted(desc)
            try:
                if via is not None:
                    req = via.post(desc, not async_op)
                elif self._stager is not None and self._stager.involves(desc):
                    req = self._stager.post(desc, not async_op)
                else:
                    req = self._transport.post(desc, not async_op)
                if not async_op and req is not DONE:
                    req.wait(self.timeout)
            except CommError as e:
                raise self._failed_op(desc.kind.label, e, entry) from None
            except BaseException as e:  # Ctrl-C, or another signal handler's exception
                self._interrupted(e, entry)
                raise
        finally:
            if exclusive:
                self._busy.release()
        if async_op:
            return Work(self, req, desc.kind.label, desc, entry)
        entry[5] = "done"
        return None

    def _lean_call(self, kind: int, label: str, x, out, op, root, counts, async_op: bool):
        """The transport's lean path for one call (see transports/base.py): None when it ran,
        its Work when posted, _SKIPPED when it does not take these arguments (the caller then
        takes the full path, whose checks name any problem). all_reduce inlines this: it is
        the latency path, and a Python frame is a tenth of its cost."""
        lean = self._lean
        if lean is None or self._failure is not None or self._closed:
            return _SKIPPED
        if self._orphans:
            self._reap_soon()
        try:
            done = (self._lean_async(self, self._busy, kind, x, out, op, root, counts, label) if async_op
                    else lean(self._busy, kind, x, out, op, root, counts, self.timeout))
        except BaseException as e:
            raise self._lean_error(label, e) from None
        if type(done) is not int:
            return done
        if done == LEAN_BUSY:
            raise self._overlap(label)
        return _SKIPPED

    def _outcome(self, req, label: str, entry, timeout: float) -> CommError | None:
        """Wait for a request (the transport's, or the engine's own Request); None, or the
        CommError it ended with (the communicator poisoned, as _post does)."""
        try:
            req.wait(timeout)
        except CommError as e:
            return self._failed_op(label, e, entry)
        except Exception as e:   # the engine's own request raises the engine's error
            return self._work_failed(label, e, entry)
        if entry is not None:
            entry[5] = "done"
        return None

    def _work_failed(self, label: str, e: Exception, entry) -> CommError:
        """The CommError of an operation whose request raised the transport's own error `e`
        (the communicator poisoned, as _post does); the engine's native Work calls it too."""
        return self._failed_op(label, self._transport.error(e), entry)

    def _reap_soon(self) -> None:
        self._reap_in -= 1
        if self._reap_in <= 0:
            self._reap()

    def _reap(self, most: int = 4) -> None:
        """Let go of dropped Works' buffers whose operations have ended, looking at the `most`
        oldest; a failure among them poisons the communicator as a waited one would. While
        none ends, the posts between looks double (up to 1024): thousands of dropped receives
        that never match then cost a post nothing (looking at 4 of them costs microseconds)."""
        released = False
        for _ in range(min(len(self._orphans), most)):
            try:
                orphan = self._orphans.popleft()
            except IndexError:  # another thread (point-to-point calls) took the rest
                return
            req, label, _, entry = orphan
            try:
                if not req.test():
                    self._orphans.append(orphan)
                    continue
            except CommError as e:
                self._failed_op(label, e, entry)
            else:
                self._outcome(req, label, entry, 0)
            released = True
        self._reap_every = 1 if released else min(2 * self._reap_every, 1024)
        self._reap_in = self._reap_every

    def _interrupted(self, exc: BaseException, entry) -> None:
        """A signal handler raised `exc` while this rank waited: the operation is half done, so
        the communicator is aborted (its peers fail at once instead of waiting for this rank)."""
        if entry is not None:
            entry[5] = "failed"
        if self._failure is None:
            self._failure = Aborted(f"interrupted by {type(exc).__name__} during an operation",
                                    rank=self.rank, op="abort")
        self._transport.abort()

    def _overlap(self, op: str) -> InvalidArgument:
        """A second thread entered a collective while another is inside one. Refused, and the
        communicator is aborted on every rank: the two threads' calls may already have run in
        different orders on different ranks, and same-signature collectives would then swap
        their data silently."""
        err = InvalidArgument(
            "another thread is inside a collective on this communicator; a communicator runs one "
            "collective at a time, posted in the same order on every rank, so it is now aborted. "
            "Call collectives from one thread, or give each thread its own communicator (split)",
            rank=self.rank, op=op)
        if self._failure is None:
            self._failure = err
        self._transport.abort()
        return err

    def _disown(self) -> None:
        """In a child forked from the owner: refuse every later call, and let the transport drop
        the child's copies of its connections (the parent keeps using them)."""
        self._foreign = True
        self._failure = CommError(
            f"this communicator belongs to pid {self._pid}, which forked this process (pid "
            f"{os.getpid()}); a forked child cannot use its parent's communicators: call comm.init() "
            "in the child", rank=self.rank)
        self._transport.forget_after_fork()

    def _refuse(self, op: str):
        if self._foreign:
            raise CommError(self._failure.cause, rank=self.rank, op=op)
        if self._closed:
            raise Closed("the communicator is closed", rank=self.rank, op=op)
        if isinstance(self._failure, Revoked):
            raise Revoked(f"the communicator was revoked ({self._failure.cause})", rank=self.rank, op=op)
        raise Aborted(f"the communicator failed earlier and takes no more work ({self._failure.cause}); "
                      "create a new one", rank=self.rank, op=op)

    def _lean_error(self, op: str, e: BaseException) -> BaseException:
        """The exception to raise for `e`, raised by the transport's lean path or a persistent
        run (which hold _busy as _post does): a signal handler's (Ctrl-C) aborts, as in _post."""
        if not isinstance(e, Exception):
            self._interrupted(e, None)
            return e
        return self._lean_failed(op, e)

    def _lean_failed(self, op: str, e: Exception) -> CommError:
        """The CommError for an exception of the transport's lean path or a persistent run."""
        if self._failure is not None or self._closed:  # failed or closed meanwhile (abort)
            try:
                self._refuse(op)
            except CommError as refused:
                return refused
        return self._failed_op(op, self._transport.error(e))

    def _failed_op(self, op: str | None, err: CommError, entry=None) -> CommError:
        """Give `err` this rank and op, poison the communicator, dump the flight recorder."""
        err.locate(self.rank, op)
        if not isinstance(err, InvalidArgument):
            if self._failure is None:
                self._failure = err
            if entry is not None:
                entry[5] = "failed"
            if isinstance(err, (CommTimeout, PeerFailure)):
                self._recorder.dump(str(err))
        return err

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, x, op=SUM, *, out=None, scale: float | None = None, async_op: bool = False,
                   compress: str | None = None):
        """Reduce x over all ranks; the result lands in x (or in `out`, leaving x untouched).
        compress="bf16" / "fp8": fewer bits between hosts, float32 sums (comm.compress)."""
        if compress is not None:
            return compression.run(self, self._all_reduce(x, op, out, scale), compress, async_op)
        lean = self._lean   # (the async lean path exists where this one does)
        if lean is not None and scale is None and self._failure is None and not self._closed:
            if self._orphans:
                self._reap_soon()
            try:
                done = (self._lean_async(self, self._busy, _ALL_REDUCE, x, out, op, None, None, "all_reduce")
                        if async_op else lean(self._busy, _ALL_REDUCE, x, out, op, None, None, self.timeout))
            except BaseException as e:
                raise self._lean_error("all_reduce", e) from None
            if type(done) is not int:
                return done   # it ran (None), or was posted (its comm.Work)
            if done == LEAN_BUSY:
                raise self._overlap("all_reduce")
        return self._post(self._all_reduce(x, op, out, scale), async_op)

    def all_reduce_init(self, x, op=SUM, *, out=None, scale: float | None = None,
                        compress: str | None = None) -> Persistent:
        """A persistent all_reduce of x: checked once, then h() (or h.start(); h.wait()) runs it."""
        return self._persistent(self._all_reduce(x, op, out, scale), compress)

    def _persistent(self, desc: OpDesc, compress: str | None):
        return Persistent(self, desc) if compress is None else compression.Persistent(self, desc, compress)

    def _all_reduce(self, x, op, out, scale) -> OpDesc:
        name = "all_reduce"
        send = self._buf(x, name, writable=out is None, what="input")
        recv = send
        if out is not None:
            recv = self._buf(out, name, writable=True, what="output")
            self._same_type(name, send, recv)
            self._count_match(name, recv.count, send.count, "output")
            self._apart(name, send, recv, 0, "in place, out is x itself")
        rop, factor = self._reduce_op(name, op, send, scale)
        return OpDesc(OpKind.ALL_REDUCE, send, recv, send.dtype, send.count, rop, factor)

    def reduce_scatter(self, out, x, op=SUM, *, scale: float | None = None, async_op: bool = False,
                       compress: str | None = None):
        """Reduce x (size * len(out) elements) over all ranks; rank r gets block r in `out`."""
        if compress is not None:
            return compression.run(self, self._reduce_scatter(out, x, op, scale), compress, async_op)
        if scale is None:
            done = self._lean_call(_REDUCE_SCATTER, "reduce_scatter", x, out, op, None, None, async_op)
            if done is not _SKIPPED:
                return done
        return self._post(self._reduce_scatter(out, x, op, scale), async_op)

    def reduce_scatter_init(self, out, x, op=SUM, *, scale: float | None = None,
                            compress: str | None = None) -> Persistent:
        """A persistent reduce_scatter (see all_reduce_init)."""
        return self._persistent(self._reduce_scatter(out, x, op, scale), compress)

    def _reduce_scatter(self, out, x, op, scale) -> OpDesc:
        name = "reduce_scatter"
        send = self._buf(x, name, writable=False, what="input")
        recv = self._buf(out, name, writable=True, what="output")
        self._same_type(name, send, recv)
        self._count_match(name, send.count, recv.count * self.size, "input")
        self._apart(name, recv, send, self.rank * recv.nbytes, f"in place, out is block {self.rank} of x")
        rop, factor = self._reduce_op(name, op, send, scale)
        return OpDesc(OpKind.REDUCE_SCATTER, send, recv, send.dtype, recv.count, rop, factor)

    def all_gather(self, out, x, *, async_op: bool = False, compress: str | None = None):
        """Concatenate every rank's x, in rank order, into `out` (size * len(x) elements)."""
        if compress is not None:
            return compression.run(self, self._all_gather(out, x), compress, async_op)
        done = self._lean_call(_ALL_GATHER, "all_gather", x, out, None, None, None, async_op)
        if done is not _SKIPPED:
            return done
        return self._post(self._all_gather(out, x), async_op)

    def all_gather_init(self, out, x, *, compress: str | None = None) -> Persistent:
        """A persistent all_gather (see all_reduce_init)."""
        return self._persistent(self._all_gather(out, x), compress)

    def _all_gather(self, out, x) -> OpDesc:
        name = "all_gather"
        send = self._buf(x, name, writable=False, what="input")
        recv = self._buf(out, name, writable=True, what="output")
        self._same_type(name, send, recv)
        self._count_match(name, recv.count, send.count * self.size, "output")
        self._apart(name, send, recv, self.rank * send.nbytes, f"in place, x is block {self.rank} of out")
        return OpDesc(OpKind.ALL_GATHER, send, recv, send.dtype, send.count)

    def all_gather_v(self, out, x, counts, *, async_op: bool = False, compress: str | None = None):
        """Blocks of any size: rank r's x (counts[r] rows) lands at rows sum(counts[:r]) of `out`
        on every rank (MPI's Allgatherv). counts: the same list on every rank; zeros allowed."""
        if compress is not None:
            return compression.run(self, vcollectives.all_gather_v(self, out, x, counts), compress, async_op)
        done = self._lean_call(_ALL_GATHER_V, "all_gather_v", x, out, None, None, counts, async_op)
        if done is not _SKIPPED:
            return done
        return self._post(vcollectives.all_gather_v(self, out, x, counts), async_op)

    def all_gather_v_init(self, out, x, counts, *, compress: str | None = None) -> Persistent:
        """A persistent all_gather_v (see all_reduce_init)."""
        return self._persistent(vcollectives.all_gather_v(self, out, x, counts), compress)

    def reduce_scatter_v(self, out, x, counts, op=SUM, *, scale: float | None = None, async_op: bool = False,
                         compress: str | None = None):
        """Reduce x (sum(counts) rows) over all ranks; rank r gets rows sum(counts[:r]) ..
        sum(counts[:r+1]) in `out` (counts[r] rows; MPI's Reduce_scatter)."""
        if compress is not None:
            return compression.run(self, vcollectives.reduce_scatter_v(self, out, x, counts, op, scale),
                                   compress, async_op)
        if scale is None:
            done = self._lean_call(_REDUCE_SCATTER_V, "reduce_scatter_v", x, out, op, None, counts, async_op)
            if done is not _SKIPPED:
                return done
        return self._post(vcollectives.reduce_scatter_v(self, out, x, counts, op, scale), async_op)

    def reduce_scatter_v_init(self, out, x, counts, op=SUM, *, scale: float | None = None,
                              compress: str | None = None) -> Persistent:
        """A persistent reduce_scatter_v (see all_reduce_init)."""
        return self._persistent(vcollectives.reduce_scatter_v(self, out, x, counts, op, scale), compress)

    def broadcast(self, x, root: int = 0, *, async_op: bool = False):
        """Copy root's x into x on every rank."""
        done = self._lean_call(_BROADCAST, "broadcast", x, None, 0, root, None, async_op)
        if done is not _SKIPPED:
            return done
        return self._post(self._broadcast(x, root), async_op)

    def broadcast_init(self, x, root: int = 0) -> Persistent:
        """A persistent broadcast (see all_reduce_init)."""
        return Persistent(self, self._broadcast(x, root))

    def _broadcast(self, x, root) -> OpDesc:
        name = "broadcast"
        buf = self._buf(x, name, writable=True, what="buffer")
        root = self._root(name, root)
        return OpDesc(OpKind.BROADCAST, buf, buf, buf.dtype, buf.count, root=root)

    def reduce(self, x, root: int = 0, op=SUM, *, out=None, scale: float | None = None, async_op: bool = False):
        """Reduce x over all ranks into root's x (or root's `out`); other ranks' buffers are untouched."""
        name = "reduce"
        root = self._root(name, root)
        send = self._buf(x, name, writable=out is None and self.rank == root, what="input")
        recv = None
        if self.rank == root:
            recv = send if out is None else self._buf(out, name, writable=True, what="output")
            self._same_type(name, send, recv)
            self._count_match(name, recv.count, send.count, "output")
            self._apart(name, send, recv, 0, "in place, out is x itself")
        rop, factor = self._reduce_op(name, op, send, scale)
        return self._post(OpDesc(OpKind.REDUCE, send, recv, send.dtype, send.count, rop, factor, root), async_op)

    def gather(self, out, x, root: int = 0, *, async_op: bool = False):
        """Concatenate every rank's x into root's `out` (other ranks may pass out=None)."""
        name = "gather"
        root = self._root(name, root)
        send = self._buf(x, name, writable=False, what="input")
        recv = None
        if self.rank == root:
            recv = self._buf(out, name, writable=True, what="output")
            self._same_type(name, send, recv)
            self._count_match(name, recv.count, send.count * self.size, "output")
            self._apart(name, send, recv, root * send.nbytes, f"in place, x is block {root} of out")
        return self._post(OpDesc(OpKind.GATHER, send, recv, send.dtype, send.count, root=root), async_op)

    def scatter(self, out, x, root: int = 0, *, async_op: bool = False):
        """Block r of root's x (size * len(out) elements) goes to rank r's `out`; non-roots pass x=None."""
        name = "scatter"
        root = self._root(name, root)
        recv = self._buf(out, name, writable=True, what="output")
        send = None
        if self.rank == root:
            send = self._buf(x, name, writable=False, what="input")
            self._same_type(name, send, recv)
            self._count_match(name, send.count, recv.count * self.size, "input")
            self._apart(name, recv, send, root * recv.nbytes, f"in place, out is block {root} of x")
        return self._post(OpDesc(OpKind.SCATTER, send, recv, recv.dtype, recv.count, root=root), async_op)

    def _splits(self, op: str, buf: Buffer, splits, what: str) -> tuple[int, ...]:
        """Rows of dim 0 per rank -> element counts per rank."""
        if len(buf.shape) == 0:
            raise self._error(op, f"{what} must have at least one dimension")
        rows = buf.shape[0]
        row = buf.count // rows if rows else 0
        if splits is None:
            if rows % self.size:
                raise self._error(op, f"{what} has {rows} rows, not divisible by the group size "
                                      f"{self.size}; pass splits")
            return (rows // self.size * row,) * self.size
        try:  # integers of any kind (numpy's too); a float or bool is a bug, never a row count
            splits = tuple(map(_integer, splits))
        except TypeError:
            raise self._error(op, f"{what} splits {splits!r} must be integers") from None
        if len(splits) != self.size:
            raise self._error(op, f"{what} splits have {_many(len(splits), 'entry', 'entries')}, one per rank of "
                                  f"a group of {_many(self.size, 'rank', 'ranks')} expected")
        if any(s < 0 for s in splits):
            raise self._error(op, f"{what} splits {list(splits)} have a negative entry")
        if sum(splits) != rows:
            raise self._error(op, f"{what} splits sum to {sum(splits)} but it has {rows} rows")
        return tuple(s * row for s in splits)

    def all_to_all(self, out, x, out_splits=None, in_splits=None, *, async_op: bool = False):
        """Rank r sends in_splits[j] rows of x to rank j and receives out_splits[j] rows from rank j,
        packed in rank order (torch's all_to_all_single). Without splits: equal blocks."""
        splits = None if in_splits is None and out_splits is None else (out_splits, in_splits)
        done = self._lean_call(_ALL_TO_ALL, "all_to_all", x, out, None, None, splits, async_op)
        if done is not _SKIPPED:
            return done
        return self._post(self._all_to_all(out, x, out_splits, in_splits), async_op)

    def all_to_all_init(self, out, x, out_splits=None, in_splits=None) -> Persistent:
        """A persistent all_to_all with these (fixed) splits (see all_reduce_init)."""
        return Persistent(self, self._all_to_all(out, x, out_splits, in_splits))

    def _all_to_all(self, out, x, out_splits, in_splits) -> OpDesc:
        name = "all_to_all"
        send = self._buf(x, name, writable=False, what="input")
        recv = self._buf(out, name, writable=True, what="output")
        self._same_type(name, send, recv)
        if send.shape[1:] != recv.shape[1:] and send.count and recv.count:
            raise self._error(name, f"input rows {send.shape[1:]} and output rows {recv.shape[1:]} differ")
        send_counts = self._splits(name, send, in_splits, "input")
        recv_counts = self._splits(name, recv, out_splits, "output")
        if in_splits is None and out_splits is None:
            self._count_match(name, recv.count, send.count, "output")
        if send_counts[self.rank] != recv_counts[self.rank]:  # the block a rank keeps is copied
            raise self._error(name, f"in_splits[{self.rank}] and out_splits[{self.rank}] differ: "
                                    "the rows a rank sends itself must equal the rows it expects")
        self._apart(name, send, recv, None)
        return OpDesc(OpKind.ALL_TO_ALL, send, recv, send.dtype, send.count,
                      send_counts=send_counts, recv_counts=recv_counts)

    def barrier(self, *, async_op: bool = False):
        """Return once every rank has entered the barrier."""
        return self._post(OpDesc(OpKind.BARRIER), async_op)

    # ---- point to point ----------------------------------------------------------------------
    def _p2p(self, kind: OpKind, x, peer: int, tag: int, async_op: bool):
        name = kind.label
        buf = self._buf(x, name, writable=kind is OpKind.RECV, what="buffer")
        if peer is None and kind is OpKind.RECV:   # from any rank
            if not self._transport.any_source:
                raise self._error(name, f"transport {self.transport!r} cannot receive from any rank; pass src")
            peer = -1
        else:
            peer = self._root(name, peer, "dst" if kind is OpKind.SEND else "src")
        if peer == self.rank:
            raise self._error(name, "cannot send to or receive from itself")
        try:
            tag_value = operator.index(tag)
        except TypeError:
            tag_value = -1
        if not 0 <= tag_value < 2**31:
            raise self._error(name, f"tag {tag!r} must be an integer in [0, 2**31)")
        desc = OpDesc(kind, buf if kind is OpKind.SEND else None, buf if kind is OpKind.RECV else None,
                      buf.dtype, buf.count, peer=peer, tag=tag_value)
        return self._post(desc, async_op, exclusive=False)

    def send(self, x, dst: int, tag: int = 0) -> None:
        """Send x to rank dst; returns when x may be reused."""
        self._p2p(OpKind.SEND, x, dst, tag, False)

    def recv(self, x, src: int | None, tag: int = 0) -> int:
        """Receive into x from rank src (x must have the sender's element count); src=None takes
        the first message with this tag from any rank. Returns the sender's rank."""
        if src is None:  # the sender is only known from the request
            work = self._p2p(OpKind.RECV, x, None, tag, True)
            work.wait()
            return work.source
        self._p2p(OpKind.RECV, x, src, tag, False)
        return src

    def isend(self, x, dst: int, tag: int = 0) -> Work:
        return self._p2p(OpKind.SEND, x, dst, tag, True)

    def irecv(self, x, src: int | None, tag: int = 0) -> Work:
        """As recv, returning at once; with src=None, the Work's `source` names the sender."""
        return self._p2p(OpKind.RECV, x, src, tag, True)

    def batch_p2p(self, ops) -> list[Work]:
        """Post many comm.P2POp (isend / irecv) at once; any order completes. Returns their Works."""
        from .p2p import batch_p2p
        return batch_p2p(self, ops)

    # ---- one-sided -----------------------------------------------------------------------------
    def window(self, buf, *, signals: int = 64) -> Window:
        """Collective: a window on every rank for put / get, with `signals` counters on each
        rank (comm.window.Window). `buf` is this rank's window: an array (host memory) to
        expose, or an int, a number of bytes the library allocates (as MPI_Win_allocate: the
        ranks of a host map each other's, so a put between them is a memcpy; w.buffer is the
        memory, zeroed). Sizes may differ per rank, 0 bytes too; ranks may mix both forms.
        Device memory is refused (InvalidArgument): put from and get into CUDA buffers
        instead, which the window stages through pinned host memory.
        Arguments one rank refuses are every rank's InvalidArgument, at once."""
        name = "window"
        if self._failure is not None or self._closed:
            self._refuse(name)
        nbytes, mem, count, cause = None, None, -1, None
        try:
            nbytes, mem = self._window_memory(buf, name)
            count = _integer(signals)
        except InvalidArgument as e:
            cause = e.cause
        except TypeError:
            pass
        if cause is None and not 0 <= count <= MAX_SIGNALS:
            cause = f"signals={signals!r} must be an integer in [0, {MAX_SIGNALS}]"
        self._agree_arguments(name, cause)
        if not self._busy.acquire(False):
            raise self._overlap(name)
        try:
            if nbytes is None:
                tw = self._transport.window(mem, count)
            else:
                tw = self._transport.window_allocate(nbytes, count)
                mem = as_buffer(tw.memory, op=name, writable=True)
        except CommError as e:
            if isinstance(e, TransportUnavailable):
                raise e.locate(self.rank, name) from None
            raise self._failed_op(name, e) from None
        finally:
            self._busy.release()
        return Window(self, tw, mem, count)

    def _window_memory(self, buf, name: str) -> tuple[int | None, Buffer | None]:
        """(nbytes, None) for memory the library allocates, (None, buffer) for an array."""
        if isinstance(buf, (bool, np.bool_)) or isinstance(buf, (float, np.floating)):
            raise self._error(name, f"nbytes={buf!r} must be an int (or pass an array to expose)")
        if isinstance(buf, (int, np.integer)):
            nbytes = int(buf)
            if nbytes < 0:
                raise self._error(name, f"nbytes={buf!r} must not be negative")
            # Shared memory is not overcommitted: pages past what the host has would bring
            # the kernel's OOM killer onto whatever process it picks, not fail this call.
            have = limits.available_memory()
            if have is not None and nbytes > have:
                raise self._error(name, f"nbytes={nbytes} is more than this host's available memory "
                                        f"({have} bytes: MemAvailable and free huge pages)")
            return nbytes, None
        # read here, not by _buf: a CUDA window must not start the collectives' staging
        try:
            mem = as_buffer(buf, op=name, writable=True)
        except InvalidArgument as e:
            raise self._error(name, f"window: {e.cause}") from None
        if mem.device != "cpu":
            # Every engine channel writes into the window from host code (memcpy, CMA, the
            # target's engine); no transport here reaches device memory, and a host shadow of
            # it would be stale between a peer's put and any GPU read.
            cuda = ", and put from / get into CUDA buffers, which windows stage through pinned host memory" \
                if mem.device == "cuda" else ""
            raise self._error(name, f"the window is on {mem.device}; windows expose host memory: pass a host "
                                    "array (pinned for fast copies to and from a GPU, e.g. torch.empty(n, "
                                    f"dtype=torch.uint8, pin_memory=True)) or c.window(nbytes){cuda}")
        return None, mem

    def _agree_arguments(self, op: str, cause: str | None) -> None:
        """Collective, for set-up calls whose ranks pass different arguments (windows): a rank
        that refuses its own makes every rank raise, rather than leave the others waiting in
        the exchange until the timeout. One 8-byte all_reduce."""
        first = np.array([self.rank if cause else self.size], np.int64)
        # a transport of device memory only (nccl) has no windows and refuses them itself
        if self.size > 1 and "cpu" in self._transport.devices:
            self.all_reduce(first, ReduceOp.MIN)
        if cause is not None:
            raise self._error(op, cause)
        if first[0] < self.size:
            raise self._error(op, f"rank {int(first[0])} refused its arguments (its own error says why); "
                                  "no rank made the window")

    # ---- groups and lifetime -----------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> "Communicator | None":
        """Collective over this group: ranks with equal color form a new communicator, ordered by
        (key, rank). color=None (or negative) takes part without joining; it gets None."""
        if self._failure is not None or self._closed:
            self._refuse("split")
        if not self._busy.acquire(False):
            raise self._overlap("split")
        try:
            return self._split(color, key)
        finally:
            self._busy.release()

    def _split(self, color: int | None, key: int | None) -> "Communicator | None":
        color = -1 if color is None else int(color)
        key = self.rank if key is None else int(key)
        self._split_count += 1
        tag = f"split{self._split_count}"
        entries = [struct.unpack("!qq", v) for v in self._ctx.store.all_gather(tag, struct.pack("!qq", color, key))]
        if color < 0:
            _set_up(self.rank, "split", self._transport.split, -1, key, None)
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
        ranks = tuple(r for _, r in members)
        ctx = self._child_context(ranks, f"{tag}/c{color}", f"{self._ctx.group_name}.{tag}.c{color}")
        transport = _set_up(self.rank, "split", self._transport.split, color, key, ctx)
        return Communicator(transport, ctx, ranks=tuple(self.ranks[r] for r in ranks))

    def _child_context(self, ranks, scope: str, group_name: str) -> BootstrapContext:
        """The bootstrap context of a group of `ranks` (numbered as here, this rank among them)
        made from this communicator (split, and shrink where the library makes the group): the
        store's view under `scope`, the members' host ids."""
        ctx, rank = self._ctx, ranks.index(self.rank)
        return BootstrapContext(rank, len(ranks), ctx.store.scoped(scope, rank, len(ranks)), self.timeout,
                                ctx.host_id, ctx.secret, ctx.bind_addr, group_name, ctx.options,
                                tuple(ctx.host_ids[r] for r in ranks) if ctx.host_ids else ())

    # ---- after a failure: revoke, agree, shrink, grow (comm.elastic) --------------------------
    def revoke(self) -> None:
        """Fail every pending and future operation on every rank with Revoked (ULFM's revoke).
        Idempotent; any rank may call it, from any thread; shrink() is the way on."""
        elastic.revoke(self)

    def agree(self, flag: int, *, timeout: float | None = None) -> int:
        """Fault-tolerant agreement: the bitwise AND of the live ranks' flags (ints in
        [0, 2**62)), the same on every survivor even when ranks die during the call. Works on a
        failed communicator; afterwards failed_ranks() says which ranks the survivors agreed
        are gone (dead, or silent past the timeout)."""
        return elastic.agree(self, flag, timeout)

    def failed_ranks(self) -> list[int]:
        """The ranks the latest agree() or shrink() of this communicator found failed."""
        return list(self._failed_ranks)

    def shrink(self, timeout: float | None = None, *, exclude=()) -> "Communicator":
        """Collective over the survivors: a new communicator without the failed ranks (and
        without `exclude`, ranks removed on purpose, which do not call it), renumbered from 0 in
        the same order. Revokes this one. A rank silent for `timeout` (default: the
        communicator's) is declared failed; the store's host may be among the dead."""
        return elastic.shrink(self, timeout, exclude, connect)

    def grow(self, count: int, *, timeout: float | None = None) -> "Communicator":
        """Collective: a new communicator of these ranks and `count` new processes, each of
        which calls comm.join(join_address()); they are numbered after the old ranks."""
        return elastic.grow(self, count, timeout, connect)

    def join_address(self) -> str:
        """The address new processes pass to comm.join() to take part in this grow()."""
        return elastic.join_address(self)

    def abort(self) -> None:
        """Fail every pending and future operation at once (any thread may call it)."""
        if self._foreign:
            self._refuse("abort")  # aborting would cut the parent's connections
        if self._failure is None:
            self._failure = Aborted("aborted by the user", rank=self.rank, op="abort")
        self._transport.abort()

    def close(self) -> None:
        """Release connections and shared memory. Idempotent; later calls raise Closed."""
        if self._closed:
            return
        self._closed = True
        if self._foreign:
            return  # the parent's to close; the child's copies went at fork
        compression.close(self)   # the sub-communicators of compressed calls
        self._transport.close()
        self._reap(len(self._orphans))  # ended now, unless the transport lets them outlive close()
        if self._stager is not None:
            self._stager.close()
        if self._owned_store is not None:
            self._owned_store.close()


def _set_up(rank: int, op: str, create, *args):
    """create(*args), with the operating system's failures (no descriptors, no memory) turned
    into CommErrors like every other failure of set-up."""
    try:
        return create(*args)
    except CommError:
        raise
    except OSError as e:
        raise from_os_error(e, rank=rank, op=op) from None


# Buffers of operations still running when their communicator was collected without close():
# kept for the life of the process, since nothing can tell any more when the transport is
# done with them. A leak, bounded by that mistake, instead of memory written after its free.
_ABANDONED: list = []

# Every communicator of this process, so a forked child can disown them all.
_LIVE: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for c in list(_LIVE):
        c._disown()


os.register_at_fork(after_in_child=_after_fork_in_child)


def transport_class(name: str, rank: int | None = None):
    """The transport registered as `name`, or TransportUnavailable saying why it cannot run here."""
    from transports import base

    cls = base.get(name)
    reason = cls.available()
    if reason is not None:
        raise TransportUnavailable(f"transport {name!r} cannot run here: {reason}", rank=rank, op="init")
    return cls


def connect(store, transport: str, group_name: str = "world", *, ranks: tuple[int, ...] | None = None,
            owned_store=None, options: dict | None = None) -> Communicator:
    """A Communicator over `transport` for the group whose bootstrap store (already scoped to the
    group, knowing its rank, size and timeout) is `store`. comm.init and the torch backend
    both end here, after their own rendezvous. `options` reach the transport (BootstrapContext):
    "cuda_device" is the GPU a CUDA transport drives."""
    cls = transport_class(transport, store.rank)
    secret = config.get("COMM_SECRET")
    if secret is None and store.size > 1:
        auth.warn_unauthenticated()
    host = rendezvous.host_id()
    host_ids = tuple(h.decode() for h in store.all_gather("topology", host.encode())) if store.size > 1 else (host,)
    ctx = BootstrapContext(store.rank, store.size, store, store.timeout, host,
                           secret.encode() if secret else None, rendezvous.bind_address(), group_name,
                           options or {}, host_ids)
    log.debug(store.rank, f"{group_name}: connecting {store.size} ranks over transport {transport}")
    world = Communicator(_set_up(store.rank, "init", cls.create, ctx), ctx, ranks=ranks, owned_store=owned_store)
    log.debug(store.rank, f"{group_name}: connected")
    return world
