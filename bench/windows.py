"""The one-sided benchmarks' operations (bench/benchmarks/onesided.py), one mixin per library.

A window's memory is Handle.mem (the library may allocate it: MPI_Win_allocate); it starts as
a copy of what open_window was given. Every rank works on a ring: it puts into (or gets from) the window of `peer` (its right
neighbour) while its left neighbour does the same to it. Each timed operation is complete at
both ends when it returns, so the libraries compare like for like:

    put_flush(h, src, peer, offset)        put, then flush(peer)
    get_flush(h, dst, peer, offset)        get, then flush(peer)
    signal_hop(h, src, peer, offset, lead) a token around the ring: put with a signal, and wait
                                           until this rank's counter moves (the target sees it)
    kv_put(h, blocks, peer, offsets)       put every block to its slot of the peer's pool, the
                                           last with a signal; wait for the left neighbour's

    CommWindows   this library: comm.Window (put / get / flush / put(signal=) / wait_signal)
                  over a window the library allocates (world.window(nbytes))
    MpiWindows    MPI RMA through mpi4py: MPI_Win_allocate + lock_all, MPI_Put / MPI_Get +
                  MPI_Win_flush; a signal is an MPI_Put of a count into a counter window after
                  a flush (MPI has no put-with-signal), seen by polling it (MPI_Win_sync)
    P2PWindows    this library's two-sided send / recv doing the same transfers (the receiver
                  posts a receive for every block): what a window saves
    MemcpyWindows a local copy of the same bytes into this rank's own window (no peer): the
                  bound of a put within one host
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


ONE_SIDED = ("put", "get", "put_signal", "kv")   # the benchmarks these operations serve


@dataclass
class Handle:
    """One window of one runner: the library's object(s), the local memory, the counter this
    rank expects next."""

    mem: np.ndarray
    win: object = None
    sig: object = None
    expect: int = 0
    scratch: dict = field(default_factory=dict)


def left_of(rank: int, peer: int, size: int) -> int:
    """The rank whose target this rank is when every rank targets rank + (peer - rank)."""
    return (2 * rank - peer) % size


class CommWindows:
    def open_window(self, mem: np.ndarray) -> Handle:
        # The library allocates the window (world.window(nbytes)), as MpiWindows' MPI_Win_allocate:
        # peers on one host map it and a put is a memcpy; across hosts it is the message path.
        win = self.world.window(mem.nbytes, signals=1)
        win.buffer[:] = mem
        win.fence()   # every window holds its start before anyone reads it
        return Handle(win.buffer, win)

    def close_window(self, h: Handle) -> None:
        h.win.close()

    def window_fence(self, h: Handle) -> None:
        h.win.fence()

    def put_flush(self, h, src, peer, offset):
        h.win.put(peer, src, offset)
        h.win.flush(peer)

    def get_flush(self, h, dst, peer, offset):
        h.win.get(peer, dst, offset)
        h.win.flush(peer)

    def signal_hop(self, h, src, peer, offset, lead):
        h.expect += 1
        if lead:
            h.win.put(peer, src, offset, signal=0)
            h.win.wait_signal(0, h.expect)
        else:
            h.win.wait_signal(0, h.expect)
            h.win.put(peer, src, offset, signal=0)
        h.win.flush(peer)   # lets the window drop src (nothing is in flight by now)

    def kv_put(self, h, blocks, peer, offsets):
        w = h.win
        last = len(blocks) - 1
        for i, (b, off) in enumerate(zip(blocks, offsets)):
            w.put(peer, b, off, signal=0 if i == last else None)
        h.expect += 1
        w.wait_signal(0, h.expect)
        w.flush(peer)


class MpiWindows:
    def open_window(self, mem: np.ndarray) -> Handle:
        # MPI_Win_allocate, not MPI_Win_create over `mem`: Open MPI then serves one host with
        # osc/sm (the peers' windows mapped), its best; MPI_Win_create gets osc/rdma here, whose
        # messages the target must answer from inside MPI (the bench's ranks, meeting outside
        # MPI between rows, waited on each other for good). The window starts as a copy of mem.
        MPI = self.MPI
        win = MPI.Win.Allocate(max(1, mem.nbytes), 1, comm=self.c)
        sig = MPI.Win.Allocate(8, 8, comm=self.c)
        local = np.frombuffer(win.tomemory(), np.uint8)[:mem.nbytes]
        local[:] = mem
        counter = np.frombuffer(sig.tomemory(), np.int64)
        counter[:] = 0
        h = Handle(local, win, sig)
        h.scratch.update(counter=counter, value=np.zeros(1, np.int64))
        h.win.Lock_all()
        h.sig.Lock_all()
        # every rank stays in MPI until all have their window: a rank that returned early and
        # waited for the others outside MPI (the bench's store) once held a slower rank's
        # MPI_Win_allocate for good, as its creation needed the early rank's progress
        self.c.Barrier()
        return h

    def close_window(self, h: Handle) -> None:
        for w in (h.win, h.sig):
            w.Unlock_all()
            w.Free()
        self.c.Barrier()   # as after the creation: nobody leaves MPI before all are done

    def window_fence(self, h: Handle) -> None:
        h.win.Flush_all()
        self.c.Barrier()
        h.win.Sync()

    def put_flush(self, h, src, peer, offset):
        h.win.Put(src, peer, offset)
        h.win.Flush(peer)

    def get_flush(self, h, dst, peer, offset):
        h.win.Get(dst, peer, offset)
        h.win.Flush(peer)

    def _signal(self, h, peer):
        # The counter is written by MPI_Put, not MPI_Accumulate: without RDMA atomics Open MPI
        # emulates accumulates with messages the target must answer from inside MPI, and a
        # target that saw its counter and left MPI held the origin's accumulate for good. One
        # writer per counter here (the left neighbour), so a put of the new count suffices.
        h.win.Flush(peer)     # the data first: MPI does not order the counter's put after it
        value = h.scratch["value"]
        value[0] += 1
        h.sig.Put(value, peer, 0)
        h.sig.Flush(peer)

    def _wait(self, h):
        # MPI progress, MPI_Win_sync, read (osc/sm: the peer's put is an aligned 8-byte store)
        h.expect += 1
        counter, c, any_ = h.scratch["counter"], self.c, self.MPI.ANY_SOURCE
        while True:
            c.Iprobe(any_)
            h.sig.Sync()
            if counter[0] >= h.expect:
                return

    def signal_hop(self, h, src, peer, offset, lead):
        if lead:
            h.win.Put(src, peer, offset)
            self._signal(h, peer)
            self._wait(h)
        else:
            self._wait(h)
            h.win.Put(src, peer, offset)
            self._signal(h, peer)

    def kv_put(self, h, blocks, peer, offsets):
        for b, off in zip(blocks, offsets):
            h.win.Put(b, peer, off)
        self._signal(h, peer)
        self._wait(h)


class P2PWindows:
    """The window is plain local memory; each transfer is a send matched by a receive."""

    def open_window(self, mem: np.ndarray) -> Handle:
        return Handle(mem)

    def close_window(self, h: Handle) -> None:
        pass

    def window_fence(self, h: Handle) -> None:
        self.world.barrier()

    def put_flush(self, h, src, peer, offset):
        left = left_of(self.rank, peer, self.size)
        r = self.world.irecv(h.mem[offset:offset + src.nbytes], left)
        self.world.send(src, peer)
        r.wait()

    def get_flush(self, h, dst, peer, offset):
        left = left_of(self.rank, peer, self.size)
        r = self.world.irecv(dst, peer)
        self.world.send(h.mem[offset:offset + dst.nbytes], left)
        r.wait()

    def signal_hop(self, h, src, peer, offset, lead):
        left = left_of(self.rank, peer, self.size)
        into = h.mem[offset:offset + src.nbytes]
        if lead:
            self.world.send(src, peer)
            self.world.recv(into, left)
        else:
            self.world.recv(into, left)
            self.world.send(src, peer)

    def kv_put(self, h, blocks, peer, offsets):
        left = left_of(self.rank, peer, self.size)
        recvs = [self.world.irecv(h.mem[off:off + b.nbytes], left, tag=i)
                 for i, (b, off) in enumerate(zip(blocks, offsets))]
        sends = [self.world.isend(b, peer, tag=i) for i, b in enumerate(blocks)]
        for w in recvs + sends:
            w.wait()


class MemcpyWindows:
    """Copies into (get: out of) this rank's own window; `local` tells the check so."""

    local = True

    def open_window(self, mem: np.ndarray) -> Handle:
        return Handle(mem)

    def close_window(self, h: Handle) -> None:
        pass

    def window_fence(self, h: Handle) -> None:
        pass

    def put_flush(self, h, src, peer, offset):
        np.copyto(h.mem[offset:offset + src.nbytes], src)

    def get_flush(self, h, dst, peer, offset):
        np.copyto(dst, h.mem[offset:offset + dst.nbytes])

    def kv_put(self, h, blocks, peer, offsets):
        for b, off in zip(blocks, offsets):
            np.copyto(h.mem[off:off + b.nbytes], b)
