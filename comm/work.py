"""Work: the handle of an asynchronous operation (torch.distributed's name and methods).

A Work holds the transport's request and waits on it through its communicator's Session
(comm.session): the session maps a failure, poisons the communicator and holds the buffers of
a Work dropped before its operation ended.
"""
from __future__ import annotations

import threading

from .core.errors import CommError

# Orders add_done_callback against _finish when threads race; uncontended it costs a few tens
# of nanoseconds, cheaper than a lock per Work (which every async call would create).
_CALLBACKS = threading.Lock()


class Work:
    """Returned by every operation called with ``async_op=True`` (and by isend / irecv).

    wait(timeout=None) blocks until the operation completes (default: the communicator's
    timeout) and raises the operation's CommError if it failed; on the native engine it runs
    the operation on the waiting thread when it has not started yet. is_completed() never
    blocks. The buffers stay referenced until the operation completes, even if the Work is
    dropped unwaited (the communicator then holds them, and releases them once it sees the end).
    """

    __slots__ = ("_session", "_req", "_label", "_keep", "_entry", "_error", "_done", "_callbacks")

    def __init__(self, session, req, label: str, keep, entry=None):
        self._session = session  # comm.session.Session: the communicator's state and posting
        self._req = req          # the transport's request (comm.core.ops.Request)
        self._label = label      # the operation's name, for errors
        self._keep = keep        # what holds the buffers (an OpDesc, or the arrays themselves)
        self._entry = entry      # the flight recorder's line for this op (None: the engine's)
        self._error: CommError | None = None
        self._done = False
        self._callbacks: list | None = None

    def __del__(self) -> None:
        # Dropped while its operation may still run (never waited): the transport may still
        # write the buffers, so the communicator holds them until it sees the operation end.
        if not self._done and self._keep is not None:
            self._session.orphan(self._req, self._label, self._keep, self._entry)

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done:
            s = self._session
            if s.foreign:
                s.refuse("wait")
            try:   # Session.outcome inlined: this is the async latency path
                self._req.wait(s.timeout if timeout is None else timeout)
            except CommError as e:
                self._finish(s.failed(self._label, e, self._entry))
            except BaseException as e:  # Ctrl-C while waiting
                s.interrupted(e, self._entry)
                raise
            else:
                if self._entry is not None:
                    self._entry[5] = "done"
                self._finish(None)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done:
            s = self._session
            if s.foreign:
                s.refuse("is_completed")
            try:
                if not self._req.test():
                    return False
            except CommError as e:
                self._finish(s.failed(self._label, e, self._entry))
                return True
            self._finish(s.outcome(self._req, self._label, self._entry, 0))
        return True

    @property
    def request(self):
        """The transport's request (comm.core.ops.Request) this Work waits on."""
        return self._req

    @property
    def source(self) -> int:
        """A completed receive's sender (its rank in the group): the one a receive from any
        rank (src=None) matched."""
        return self._req.source

    def exception(self) -> CommError | None:
        """The error the operation ended with, or None (also while it is still running)."""
        self.is_completed()
        return self._error

    def add_done_callback(self, fn) -> None:
        """Call fn(work) once the operation is known to have completed (from wait/is_completed,
        or at once if it already has). Used by the torch backend's futures."""
        with _CALLBACKS:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, error: CommError | None) -> None:
        with _CALLBACKS:
            if self._done:
                return
            self._error, self._done = error, True
            self._keep = None  # release the buffers
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)
