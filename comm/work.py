"""Work: the handle of an asynchronous operation (torch.distributed's name and methods)."""
from __future__ import annotations

import threading

from .errors import CommError


class Work:
    """Returned by every operation called with ``async_op=True`` (and by isend / irecv).

    wait(timeout=None) blocks until the operation completes (default: the communicator's
    timeout) and raises the operation's CommError if it failed; is_completed() never blocks.
    The buffers stay referenced until the operation completes, even if the Work is dropped
    unwaited (the communicator then holds them, and releases them once it sees the end).
    """

    __slots__ = ("_comm", "_req", "_desc", "_entry", "_error", "_done", "_callbacks", "_lock")

    def __init__(self, comm, req, desc, entry):
        self._comm = comm
        self._req = req
        self._desc = desc
        self._entry = entry  # the flight recorder's line for this op
        self._error: CommError | None = None
        self._done = False
        self._callbacks: list = []
        self._lock = threading.Lock()

    def __del__(self) -> None:
        # Dropped while its operation may still run (never waited, or a persistent handle
        # dropped after start()): the transport may still write the buffers, so the
        # communicator holds them until it sees the operation end.
        if not self._done and self._desc is not None:
            self._comm._orphans.append((self._req, self._desc, self._entry))

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done:
            if self._comm._foreign:
                self._comm._refuse("wait")
            try:
                self._req.wait(self._comm.timeout if timeout is None else timeout)
            except CommError as e:
                self._finish(self._comm._failed_op(self._desc.kind.label, e, self._entry))
            except BaseException as e:  # Ctrl-C while waiting
                self._comm._interrupted(e, self._entry)
                raise
            else:
                self._finish(None)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done:
            if self._comm._foreign:
                self._comm._refuse("is_completed")
            try:
                if not self._req.test():
                    return False
            except CommError as e:
                self._finish(self._comm._failed_op(self._desc.kind.label, e, self._entry))
                return True
            self._finish(None)
        return True

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
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self, error: CommError | None) -> None:
        with self._lock:
            if self._done:
                return
            self._error, self._done = error, True
            self._entry[5] = "failed" if error is not None else "done"
            callbacks, self._callbacks = self._callbacks, []
            self._desc = None  # release the buffers
        for fn in callbacks:
            fn(self)
