"""The torch backend's Work, its completion thread, and its errors as torch sees them.

A blocking call (torch's ``async_op=False``) runs on the caller's thread through the
communicator's blocking path and returns a ``DoneWork``, complete and successful from the start
(cheap to make: on small operations the Work is a visible part of the latency). An asynchronous one
is completed by the communicator's completion thread, which waits on the operations in posting
order and resolves the Work's future without anyone calling wait(): DDP's communication hooks
build on that. One with nothing to do after its operations (no staged copies) reaches that
thread only once its future is asked for: until then wait() completes it on the caller's
thread (the communicator's wait runs the operation there; no thread hand-off), and
is_completed() once its operations have ended (the engine progresses them meanwhile). The future is resolved before the Work counts as done, so ``then`` callbacks
have run when wait() returns (as with gloo), and a process that exits right after wait()
never leaves a callback running on a thread the interpreter is tearing down.

Errors leaving the backend are torch's ``DistBackendError`` as well as the comm error they
were raised as, and timeouts say "Timed out", torch's wording, which tools match on.
"""
from __future__ import annotations

import datetime
import queue
import threading

import torch
import torch.distributed as dist

from ..core import errors
from ..core.errors import CommError, CommTimeout


# ---- errors: comm's classes, also torch's DistBackendError ------------------------------------
def _dist_class(cls: type) -> type:
    """`cls` with torch's DistBackendError as a second base; defined in this module under its
    own name (DistCommTimeout, ...) so errors still pickle."""
    name = f"Dist{cls.__name__}"
    made = globals().get(name)
    if made is None:
        made = type(name, (cls, dist.DistBackendError), {"__module__": __name__, "__qualname__": name})
        globals()[name] = made
    return made


def as_torch_error(e: CommError) -> CommError:
    """The same error (rank, op, cause, traceback), now also a DistBackendError."""
    if isinstance(e, dist.DistBackendError):
        return e
    if isinstance(e, CommTimeout) and "Timed out" not in e.cause:
        lowered = e.cause.startswith("timed out")
        e.cause = f"T{e.cause[1:]}" if lowered else f"Timed out: {e.cause}"
    e.__class__ = _dist_class(type(e))
    e.args = (e._text(),)
    return e


BACKEND = "comm"   # its torch.distributed name


class Unsupported(CommError, NotImplementedError):
    """An operation or argument the backend does not serve (torch calls it "does not support")."""


for _cls in (CommError, errors.InvalidArgument, CommTimeout, errors.PeerFailure, errors.Aborted,
             errors.Closed, errors.Mismatch, errors.TransportUnavailable, Unsupported):
    _dist_class(_cls)


def seconds(timeout) -> float | None:
    """torch's timeout (timedelta, seconds, or <= 0 / None for "the default") -> seconds or None."""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    return timeout if timeout is not None and timeout > 0 else None


# ---- Work --------------------------------------------------------------------------------------
_work_init = dist.distributed_c10d.Work.__init__   # (not super(): its lookup is per Work made)


class TorchWork(dist.distributed_c10d.Work):
    """torch's Work over one or more comm operations. Its future holds `result` (the output
    tensors DDP hooks read) and completes when they do, whether or not wait() is called."""

    # Defaults as class attributes, set per work only where they differ: on small operations
    # the Work's construction is a visible part of the latency.
    _copies = ()        # (destination, staging) pairs to copy back on success
    _source = -1        # receives: the sender's group rank, once known
    _device = None      # CUDA: the future knows its device (its consumers' streams wait on it)
    _streamed = None    # requests whose end is a CUDA event (nccl)
    _future = None      # made on first get_future()
    _finished = False   # the outcome is known (the future may still run callbacks)
    _done = False       # ... and the callbacks ran: the work is complete
    _event = None       # a threading.Event, made only for a thread that must block on _done
    _completer = None   # the thread resolving the future right now
    _error = None
    _pending = None     # (comm works, Completer) not yet handed to the completion thread (_defer)

    def __init__(self, pg, op: str, result: list, copies=(), source: int = -1, *, device=None):
        _work_init(self)
        self._pg, self._op, self._result = pg, op, result
        self._lock = threading.Lock()
        if copies:
            self._copies = copies
        if source >= 0:
            self._source = source
        if device is not None and device.type == "cuda":
            self._device = torch.device("cuda", torch.cuda.current_device()) if device.index is None else device

    def _defer(self, comm_works, completer: "Completer") -> None:
        """Leave the comm works to whoever comes first: wait() or is_completed() on the caller's
        thread, or the completion thread once get_future() is called."""
        self._pending = (comm_works, completer)

    def _take(self):
        """The deferred comm works, now this caller's to complete; None if someone took them.
        (A dict's pop is atomic under the GIL: of two threads taking at once, one gets them,
        without the cost of a lock on the asynchronous path.)"""
        return self.__dict__.pop("_pending", None)

    def _stream_ordered(self, comm_works) -> bool:
        """True when every operation completes on a CUDA stream (nccl) and nothing is copied
        back on the host: wait() can then order the caller's stream without blocking."""
        reqs = [w.request for w in comm_works if w is not None]
        if self._device is None or self._copies or not all(hasattr(r, "stream_wait") for r in reqs):
            return False
        self._streamed = reqs
        return True

    def _complete(self, comm_works, timeout: float | None) -> None:
        """Wait on the comm operations, copy staged outputs back, resolve the future (running its
        callbacks), then mark the work done. (Small operations' async latency is mostly this
        method and the Work's construction: it does no more than the case at hand needs.)"""
        try:
            for w in comm_works:
                if w is None:
                    continue
                if isinstance(w, TorchWork):   # coalesced: done means done on the GPU too
                    w._host_wait(timeout)
                else:
                    w.wait(timeout)
                    if self._op == "recv" and self._source < 0:
                        self._source = w.source
            if self._copies:
                for dst, src in self._copies:
                    dst.copy_(src)
                if self._device is not None:   # the copies ran on this thread's stream
                    torch.cuda.current_stream(self._device).synchronize()
        except CommError as e:
            self._error = as_torch_error(e)
        except BaseException as e:  # delivered to whoever waits, and to the future
            self._error = e
        if self._copies:
            self._copies = ()
        lock = self._lock
        with lock:
            future, self._finished = self._future, True   # a later get_future() resolves its own
            if future is not None:   # its callbacks' own waits on this thread must not block
                self._completer = threading.get_ident()
        if future is not None:
            self._resolve(future)
        with lock:
            self._completer, self._done, event = None, True, self._event
        if event is not None:
            event.set()

    def _resolve(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._result)

    def wait(self, timeout=None) -> bool:
        """CUDA work on nccl: the caller's current stream waits for it, the host does not (as
        torch's NCCL backend). Everything else: block until done (synchronize() always blocks)."""
        if self._streamed is not None and self._error is None:
            for req in self._streamed:
                req.stream_wait()
            return True
        return self._host_wait(timeout)

    def _host_wait(self, timeout=None) -> bool:
        if self._pending is not None and (pending := self._take()) is not None:
            self._complete(pending[0], None if timeout is None else seconds(timeout))   # done on return
        elif not self._done and self._completer != threading.get_ident():
            # torch passes 0 for "no timeout": the completion thread's own waits are bounded
            # by the communicator's timeout, so the slack only covers the hand-off.
            limit = seconds(timeout) or self._pg.timeout + 30
            with self._lock:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(limit):
                raise as_torch_error(CommTimeout(f"not completed within {limit:g} s",
                                                 rank=self._pg.rank(), op=self._op))
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        pending = self._pending
        if pending is not None and all(w is None or w.is_completed() for w in pending[0]):
            if (pending := self._take()) is not None:
                self._complete(pending[0], None)   # ended: nothing blocks
        return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list:
        self._host_wait()
        return self._result

    def source_rank(self) -> int:
        """The sender of a receive from any source (its rank in the group)."""
        self._host_wait()
        if self._source < 0:
            raise as_torch_error(errors.InvalidArgument("source_rank() is only defined for receives",
                                                        rank=self._pg.rank(), op=self._op))
        return self._source

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                self._future = (torch.futures.Future(devices=[self._device]) if self._device
                                else torch.futures.Future())
                if self._finished:
                    self._resolve(self._future)
            future, pending = self._future, self._take()
        if pending is not None:   # its consumer may never call wait(): the thread completes it
            if self._pg._closed:   # the thread is gone; the operations ended with the group
                self._complete(pending[0], None)
            else:
                pending[1].submit(self, pending[0])
        return future

    def synchronize(self) -> None:
        """Block the host until the work is done (on CUDA too)."""
        self._host_wait()


class DoneWork(TorchWork):
    """The work of a blocking call that succeeded, complete before it is returned. Made per
    call, so it sets only its group, op and result (no lock of its own), and its waits return
    at once."""

    _finished = _done = True
    _lock = threading.Lock()   # shared: only get_future() takes it, briefly

    def __init__(self, pg, op: str, result: list):
        _work_init(self)
        self._pg, self._op, self._result = pg, op, result

    def wait(self, timeout=None) -> bool:
        return True

    def _host_wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Completer:
    """One thread per communicator that completes asynchronous work in posting order.
    stop() lets it finish what is queued (the communicator's close fails what is still
    pending) and joins it: a thread left inside a callback at exit aborts the process."""

    def __init__(self, name: str, timeout: float):
        self.timeout = timeout
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: TorchWork, comm_works) -> None:
        self._queue.put((work, comm_works))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            item[0]._complete(item[1], self.timeout)
            item = None  # drop the comm works (and their buffers) before blocking again

    def stop(self) -> None:
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
