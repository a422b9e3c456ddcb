"""The error hierarchy. Every error names the rank, the operation and the cause; and the two
helpers argument checks word their errors with."""
from __future__ import annotations

import errno
import operator


class CommError(RuntimeError):
    """Base of every error this library raises: ``[rank R] OP: cause``."""

    def __init__(self, cause: str, *, rank: int | None = None, op: str | None = None):
        self.cause = cause
        self.rank = rank
        self.op = op
        super().__init__(self._text())

    def _text(self) -> str:
        where = f"[rank {self.rank}] " if self.rank is not None else ""
        what = f"{self.op}: " if self.op else ""
        return f"{where}{what}{self.cause}"

    def locate(self, rank: int, op: str | None) -> "CommError":
        """Fill in the rank and operation where a lower layer did not know them."""
        if self.rank is None:
            self.rank = rank
        if self.op is None:
            self.op = op
        self.args = (self._text(),)
        return self

    def __reduce__(self):  # keep the keyword-only fields through pickling (multiprocessing)
        return (_rebuild, (type(self), self.cause, self.rank, self.op, self.__dict__))


def _rebuild(cls, cause, rank, op, state):
    err = cls(cause, rank=rank, op=op)   # every subclass takes these; extras come from state
    err.__dict__.update(state)
    return err


def from_os_error(e: OSError, *, rank: int | None, op: str | None) -> CommError:
    """A CommError for an operating-system failure (no sockets, no memory, no descriptors)."""
    cause = e.strerror or str(e)
    if e.errno in (errno.EMFILE, errno.ENFILE):
        cause += ": raise the open-file limit (`ulimit -n`) or close files"
    return CommError(cause, rank=rank, op=op)


class InvalidArgument(CommError, ValueError):
    """Bad input, refused on the caller's rank before anything was sent."""


class CommTimeout(CommError, TimeoutError):
    """An operation did not finish within the communicator's timeout."""


class PeerFailure(CommError):
    """A peer died or its connection broke; `peer` is the lost rank when known."""

    def __init__(self, cause: str, *, rank: int | None = None, op: str | None = None,
                 peer: int | None = None):
        super().__init__(cause, rank=rank, op=op)
        self.peer = peer


class Aborted(CommError):
    """The communicator was aborted (by abort() or after an earlier failure)."""


class Revoked(Aborted):
    """A rank revoked the communicator (revoke(), or shrink() on a survivor): it takes no more
    work; shrink() it to go on with the live ranks."""


class Excluded(CommError):
    """The survivors declared this rank failed (dead, or silent past the timeout) and went on
    without it: it cannot take part in their communicators any more."""


class Closed(CommError):
    """The communicator was closed."""


class Mismatch(CommError):
    """Ranks called different collectives (op, count, dtype or root differ)."""


class TransportUnavailable(CommError):
    """The transport asked for cannot run here (missing library or device)."""


def _integer(v) -> int:
    """v as an int: any integer type (numpy's too), but not bool or float (TypeError)."""
    if isinstance(v, bool):
        raise TypeError("bool is not an integer here")
    return operator.index(v)


def _many(n: int, one: str, more: str) -> str:
    """'1 entry', '3 entries': a count in an error message."""
    return f"{n} {one if n == 1 else more}"
