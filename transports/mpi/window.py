"""One-sided windows on the mpi transport: MPI-3 RMA (comm.window over transport "mpi").

A window is two MPI windows (the user's buffer and `signals` int64 counters), each held in one
passive-target epoch (MPI_Win_lock_all) until close, so every put / get is one MPI call. MPI has
no put-with-signal and does not order a put before an accumulate, so a signal is a flush, an
MPI_Accumulate on the counter and a second flush. Progress and Open MPI's osc: docs/transports.md.
"""
from __future__ import annotations

import numpy as np

from comm.core.buffers import Buffer
from comm.core.errors import Aborted, CommTimeout

from ..base import TransportWindow, poll_until


class MPIWindow(TransportWindow):
    """A window of an MPITransport (`t`); `mpi` is mpi4py.MPI, `error` maps MPI.Exception to
    CommError (both handed in by the transport, which owns them)."""

    def __init__(self, t, mem: Buffer, signals: int, mpi, error):
        self._t, self._mpi, self._error = t, mpi, error
        self._mem = mem   # the window's memory must outlive the MPI window
        # a 0-byte window still needs a buffer object: MPI_Win_create takes a base and a size
        memory = mpi.buffer.fromaddress(mem.ptr, mem.nbytes) if mem.nbytes else np.empty(0, np.uint8)
        self._counters = np.zeros(max(1, signals), np.int64)
        self._one = np.ones(1, np.int64)
        self._win = self._sig = None
        try:
            self.sizes = tuple(t.comm.allgather(mem.nbytes))
            self._win = mpi.Win.Create(memory, 1, comm=t.comm)
            # only SUM and NO_OP touch the counters, unordered: lets an osc use its network's
            # atomics instead of a lock at the target (Open MPI's osc/ucx otherwise locks, and a
            # target polling its own counter starves the origin's accumulate)
            info = mpi.Info.Create()
            info.update({"accumulate_ops": "same_op_no_op", "accumulate_ordering": "none"})
            self._sig = mpi.Win.Create(self._counters, 8, info, comm=t.comm)
            info.Free()
            for w in (self._win, self._sig):
                w.Set_errhandler(mpi.ERRORS_RETURN)
                w.Lock_all(mpi.MODE_NOCHECK)   # one passive epoch for the window's whole life
            # nobody returns before every rank has the window: a rank that went on to wait
            # outside MPI could hold a slower rank's creation, which needs its progress
            t.comm.Barrier()
        except mpi.Exception as e:
            self._free()
            raise error(e) from None

    def _bytes(self, buf: Buffer):
        return [self._mpi.buffer.fromaddress(buf.ptr, buf.nbytes), self._mpi.BYTE]

    def put(self, peer: int, src: Buffer, offset: int, signal: int) -> None:
        try:
            if src.nbytes:
                self._win.Put(self._bytes(src), peer, (offset, src.nbytes, self._mpi.BYTE))
            if signal >= 0:
                # data first: everything this rank put to `peer` has landed before the counter moves
                self._win.Flush(peer)
                self._sig.Accumulate([self._one, self._mpi.INT64_T], peer, (signal, 1, self._mpi.INT64_T),
                                     self._mpi.SUM)
                self._sig.Flush(peer)
        except self._mpi.Exception as e:
            raise self._error(e) from None

    def get(self, peer: int, dst: Buffer, offset: int) -> None:
        if not dst.nbytes:
            return
        try:
            self._win.Get(self._bytes(dst), peer, (offset, dst.nbytes, self._mpi.BYTE))
        except self._mpi.Exception as e:
            raise self._error(e) from None

    def flush(self, peer: int) -> None:
        try:
            if peer < 0:
                self._win.Flush_all()
            else:
                self._win.Flush(peer)
        except self._mpi.Exception as e:
            raise self._error(e) from None

    def signal(self, k: int) -> int:
        if self._t._aborted:
            raise Aborted("the communicator was aborted")
        try:
            # MPI progress first (an osc that emulates RMA with messages needs the target to
            # call in), then MPI_Win_sync: in the unified model (both osc here) the counter's
            # public and private copies are then one, and an aligned 8-byte load is atomic.
            # (MPI_Fetch_and_op(NO_OP) on itself would be the portable read, but under osc/ucx
            # a target polling it starves the origins' accumulates: signals arrived only
            # after the target stopped polling.)
            self._t.comm.Iprobe(self._mpi.ANY_SOURCE, self._mpi.ANY_TAG)
            self._sig.Sync()
        except self._mpi.Exception as e:
            raise self._error(e) from None
        return int(self._counters[k])

    def wait_signal(self, k: int, value: int, timeout_s: float) -> None:
        poll_until(lambda: self.signal(k) >= value, timeout_s, lambda: CommTimeout(
            f"signal {k} is {self.signal(k)} after {timeout_s:g} s, waiting for {value} "
            "(a peer is slow, hung, or did not put with this signal)"))

    def fence(self) -> None:
        self.flush(-1)
        self._barrier()
        self._win.Sync()   # this rank's own loads see what the peers put (separate-model MPIs)

    def _barrier(self) -> None:
        try:
            req = self._t.comm.Ibarrier()
        except self._mpi.Exception as e:
            raise self._error(e) from None
        timeout = self._t.timeout

        def done():
            if self._t._aborted:
                raise Aborted("the communicator was aborted")
            try:
                return req.Test()
            except self._mpi.Exception as e:
                raise self._error(e) from None

        poll_until(done, timeout, lambda: CommTimeout(
            f"window fence: not every rank reached it within {timeout:g} s"))

    def close(self) -> None:
        # comm.Window fenced first on a healthy communicator. MPI_Win_free is collective: on an
        # aborted or failed one the peers may never come, so the MPI windows are left behind
        # (their memory stays pinned by MPI until the process ends) rather than hang here.
        if self._t._aborted or self._t.comm == self._mpi.COMM_NULL:
            self._win = self._sig = None
            return
        self._free()

    def _free(self) -> None:
        for w in (self._win, self._sig):
            if w is None:
                continue
            try:
                w.Unlock_all()
            except self._mpi.Exception:
                pass   # never locked: creation failed half way
            w.Free()
        self._win = self._sig = None
