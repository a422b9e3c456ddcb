"""Persistent collectives (MPI 4's MPI_Allreduce_init): set up once, started many times.

    h = world.all_reduce_init(x, op=comm.SUM)   # arguments checked, algorithm chosen, once
    for step in range(n):
        ...write x...
        h()                                     # start + wait; or h.start() ... h.wait()
    h.close()

Made by Communicator.all_reduce_init, all_gather_init, reduce_scatter_init, broadcast_init
and all_to_all_init (fixed splits). Every rank must set up the same handles and start them
in the same order, as for the one-shot calls. The handle holds its buffers; each start
refuses, with InvalidArgument, a buffer that was resized, reallocated or freed since set-up
(a torch tensor's resize_ or set_, numpy's resize): the operation would otherwise write
memory that is no longer the caller's. The data in the buffers is read at each start.

On the native engine h() and start() are one native call each, and wait() runs a started
operation on the caller's thread unless the engine already began it; other transports post
the prepared descriptor on each start.
"""
from __future__ import annotations

from .core.buffers import as_buffer
from .core.errors import InvalidArgument
from .core.ops import OpDesc, held_buffers
from .work import Work


class Persistent:
    """A prepared collective. start() posts it, wait(timeout=None) waits for it (raising the
    operation's CommError, as Work.wait does), h() does both, close() releases the buffers.
    One operation in flight per handle: wait() before the next start()."""

    # _work: the started operation: the request of the prepared op's start (the engine's),
    # or a comm.Work (from Session.post)
    __slots__ = ("_session", "_desc", "_label", "_prepared", "_run", "_start", "_work")

    def __init__(self, session, desc: OpDesc):
        self._session = session   # comm.session.Session of the communicator
        self._desc = desc
        self._label = desc.kind.label
        session.usable(self._label + "_init")
        stager = session.stager
        staged = stager is not None and stager.involves(desc)  # CUDA data, CPU transport
        prepared = None if staged else session.transport.prepare(desc)
        self._prepared = prepared if prepared is not None else _Reposted(session, desc, staged)
        self._run = getattr(prepared, "run", None)  # start + wait in one call, where there is one
        self._start = getattr(prepared, "start", None)  # the lean start, where there is one
        self._work = None

    def __del__(self) -> None:
        # Dropped after a lean start() without wait(): the engine may still write the buffers
        # (the prepared op holds them), so the communicator holds them until the op ends. A
        # comm.Work started through Session.post does the same itself.
        work = getattr(self, "_work", None)
        if work is not None and type(work) is not Work:
            self._session.orphan(work, self._label, self._prepared, None)

    def __repr__(self) -> str:
        state = "closed" if self._desc is None else "started" if self._work is not None else "ready"
        return f"<comm.Persistent {self._label} on rank {self._session.rank} ({state})>"

    def __call__(self) -> None:
        """start() and wait(), on the caller's thread where the transport allows."""
        s, run = self._session, self._run
        if run is not None and self._work is None and s.ok:
            try:
                ran = run(s.busy, s.timeout)
            except BaseException as e:
                raise s.lean_error(self._label, e) from None
            if not ran:   # False: another thread is inside a collective, nothing was done
                raise s.overlap(self._label)
            return
        self._ready()
        s.post(self._desc, False, self._prepared)

    def start(self) -> None:
        """Post the operation and return at once; wait() completes it."""
        s, start = self._session, self._start
        if start is not None and self._work is None and s.ok:
            if s.orphans:
                s.reap_soon()
            try:
                work = start(s.busy)
            except BaseException as e:
                raise s.lean_error(self._label, e) from None
            if work is None:   # another thread is inside a collective, nothing was done
                raise s.overlap(self._label)
            self._work = work
            return
        self._ready()
        self._work = s.post(self._desc, True, self._prepared)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the started operation (default: the communicator's timeout)."""
        work, s = self._work, self._session
        if work is None:
            raise InvalidArgument("wait() without a start()", rank=s.rank, op=self._label)
        self._work = None
        if type(work) is Work:
            work.wait(timeout)
            return
        try:
            work.wait(s.timeout if timeout is None else timeout)
        except BaseException as e:
            raise s.lean_error(self._label, e) from None

    def close(self) -> None:
        """Wait for a started operation, then release the buffers. Idempotent."""
        try:
            if self._work is not None:
                self.wait()
        finally:
            self._desc = self._prepared = self._run = self._start = None

    def __enter__(self) -> "Persistent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ready(self) -> None:
        if self._desc is None:
            raise InvalidArgument("the persistent operation is closed", rank=self._session.rank, op=self._label)
        if self._work is not None:
            raise InvalidArgument("already started: wait() before starting it again",
                                  rank=self._session.rank, op=self._label)


class _Reposted:
    """The persistent form on transports without their own: the descriptor was validated at
    set-up; each start re-reads the buffers (refusing changed ones) and posts it."""

    __slots__ = ("_send", "_held", "_rank", "_label")

    def __init__(self, session, desc: OpDesc, staged: bool):
        self._send = session.stager.post if staged else session.transport.post
        self._held = held_buffers(desc)
        self._rank, self._label = session.rank, desc.kind.label

    def post(self, desc: OpDesc, blocking: bool):
        for obj, buf, written, what in self._held:
            try:
                now = as_buffer(obj, op=self._label, writable=written)
            except InvalidArgument as e:
                now, cause = None, e.cause
            if now is None or now.ptr != buf.ptr or now.count != buf.count:
                raise InvalidArgument(
                    f"the {what} buffer "
                    f"{'changed (' + cause + ')' if now is None else 'was resized, reallocated or freed'} "
                    "since the persistent operation was set up; set it up again with the current buffer",
                    rank=self._rank, op=self._label)
        return self._send(desc, blocking)
