"""One-sided communication: a window of memory every rank exposes, put / get into peers'
windows, and signal counters (Communicator.window).

    with world.window(pool) as w:          # collective: every rank exposes `pool`
        w.put(peer, block, offset, signal=request_id % 64)
        w.flush()                          # or let the target wait_signal(k, n)

    w = world.window(1 << 20)              # the library allocates the window (as
    pool = w.buffer                        # MPI_Win_allocate): peers on this host map it,
                                           # so a put to them is a memcpy

A transport's window (transports.base.TransportWindow) moves the bytes; this layer does all
argument checking (peer, offset, size and signal index against `sizes` before anything
moves), keeps every source and destination alive until the flush that completes it (the
engine reads and writes them after put / get return, as MPI_Put does), refuses a window whose
buffer was resized or freed under it (torch tensors), and refuses every call once the window
or its communicator is closed, revoked or failed.

put / get / flush try the transport's lean calls first (TransportWindow.put_lean...): they take
the plain case (a numpy array or CPU tensor, exact ints in range) in one native call, moving
nothing otherwise, and the full path below then checks, names the error or does the work.
A lean put that completes inside the call (a mapped or CMA peer) leaves nothing to hold.

CUDA sources and destinations (the serving case: prefill's KV blocks live on the GPU) are
staged through pinned host memory, as CUDA buffers on the CPU transports' collectives are
(comm.staging.WindowStaging; the lean calls take host arrays only and pass them by): put copies
src down and synchronises before the host put starts, get lands in a pinned block that the
flush (or fence, or close) completing it copies to dst before returning. The window's memory
itself is host memory (Communicator.window refuses device memory).
"""
from __future__ import annotations

import operator

from .core.buffers import Buffer, as_buffer
from .core.errors import Closed, CommError, CommTimeout, InvalidArgument

MAX_SIGNALS = 1 << 16   # signal counters per window: 8 bytes each on every rank


class Window:
    """A window of memory on every rank of a communicator. Create with Communicator.window().

    put and get are non-blocking: their bytes move in the engine (the target's application
    thread does nothing); a src must not change and a dst must not be read until flush()."""

    def __init__(self, session, transport_window, mem: Buffer, signals: int) -> None:
        self._session = session   # comm.session.Session of the communicator
        self._tw = transport_window
        self._mem = mem
        self._signals = signals
        self.sizes: tuple[int, ...] = tuple(transport_window.sizes)
        self.rank, self.size = session.rank, session.size
        # peer -> buffers the engine may still read or write: let go at the flush that ends them
        self._held: dict[int, list] = {}
        # peer -> the pinned copies (comm.staging._Staged) of CUDA buffers, likewise: that flush
        # copies a get's block up to its CUDA destination, then gives the blocks back
        self._staged: dict[int, list] = {}
        self._cuda = None   # a comm.staging.WindowStaging from the first CUDA buffer on
        self._closed = False
        # The lean calls, unless the window's memory is a torch tensor (its resize check is
        # the full path's); None once closed.
        lean = not type(mem.obj).__module__.startswith("torch")
        self._put_lean = transport_window.put_lean if lean else None
        self._get_lean = transport_window.get_lean if lean else None
        self._flush_lean = transport_window.flush_lean if lean else None
        self._wait_lean = transport_window.wait_signal_lean if lean else None

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<comm.Window{state} of {self.sizes[self.rank]} bytes on rank {self.rank} of {self.size}>"

    def __enter__(self) -> "Window":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif not self._closed:  # a failed body: a collective close could hang on ranks that
            self._set_closed()   # never get there, so only this rank's side is let go
            self._tw.close()

    @property
    def buffer(self):
        """This rank's window memory: for world.window(nbytes) a numpy uint8 array of the
        library's memory (torch.from_numpy(w.buffer) wraps it without a copy), else the array
        the window was made over. Peers write into it until close(); an array taken from it
        stays readable after close while you hold it, but nobody writes into it any more."""
        if self._closed:
            raise Closed("the window is closed", rank=self.rank, op="buffer")
        memory = self._tw.memory
        return self._mem.obj if memory is None else memory

    @property
    def signals(self) -> int:
        """How many signal counters each rank has (indices 0 .. signals - 1)."""
        return self._signals

    # ---- checks ------------------------------------------------------------------------------
    def _error(self, op: str, cause: str) -> InvalidArgument:
        return InvalidArgument(cause, rank=self.rank, op=op)

    def _usable(self, op: str) -> None:
        """Refuse a call on a closed window, a closed / revoked / failed communicator, or a
        window whose memory moved under it."""
        self._session.usable(op)
        if self._closed:
            raise Closed("the window is closed", rank=self.rank, op=op)
        obj = self._mem.obj
        if self._mem.nbytes and type(obj).__module__.startswith("torch"):
            # resize_ / set_ / a freed storage would leave peers writing into memory that is
            # no longer the window (or no longer ours): refused, and the window closed
            try:
                ptr, nbytes = obj.data_ptr(), obj.untyped_storage().nbytes() - obj.storage_offset() * obj.element_size()
            except RuntimeError:
                ptr, nbytes = 0, 0
            if ptr != self._mem.ptr or nbytes < self._mem.nbytes:
                raise self._error(op, f"the window's tensor changed under it (data at {ptr:#x}, {nbytes} "
                                      f"bytes; the window is {self._mem.nbytes} bytes at {self._mem.ptr:#x}): "
                                      "resized or freed; a window's memory must live, unchanged, until close()")

    def _peer(self, op: str, peer) -> int:
        try:
            p = operator.index(peer)
        except TypeError:
            p = None
        if p is None or isinstance(peer, bool) or not 0 <= p < self.size:
            raise self._error(op, f"peer {peer!r} is out of range for a group of {self.size}")
        return p

    def _range(self, op: str, peer: int, offset, nbytes: int) -> int:
        try:
            off = operator.index(offset)
        except TypeError:
            raise self._error(op, f"offset {offset!r} must be an integer") from None
        size = self.sizes[peer]
        if off < 0 or off + nbytes > size:
            raise self._error(op, f"{nbytes} bytes at offset {off} do not fit rank {peer}'s window of "
                                  f"{size} bytes")
        return off

    def _signal_index(self, op: str, k) -> int:
        try:
            i = operator.index(k)
        except TypeError:
            i = None
        if i is None or isinstance(k, bool) or not 0 <= i < self._signals:
            raise self._error(op, f"signal {k!r} is out of range: the window has {self._signals} signals "
                                  f"(0 .. {self._signals - 1})")
        return i

    def _buffer(self, op: str, x, writable: bool, what: str) -> Buffer:
        try:
            buf = as_buffer(x, op=op, writable=writable)
        except InvalidArgument as e:
            raise self._error(op, f"{what}: {e.cause}") from None
        if buf.device not in ("cpu", "cuda"):
            raise self._error(op, f"{what} is on {buf.device}; windows move host memory and CUDA buffers "
                                  "(copy it to the CPU)")
        return buf

    def _stage(self, op: str, peer: int, buf: Buffer, what: str) -> Buffer:
        """The pinned host copy of CUDA buffer `buf` (a put's src, copied down already, or a
        get's dst) that the transport moves instead, held for `peer`'s next flush. Staging
        is made on first use: TransportUnavailable, nothing moved and the communicator
        intact, where this process cannot run CUDA (a CUDA call failing, likewise)."""
        try:
            if self._cuda is None:
                from .staging import WindowStaging
                self._cuda = WindowStaging()
            staged, host = (self._cuda.put_source if what == "src" else self._cuda.get_target)(buf)
        except CommError as e:
            e.cause = f"{what} is a CUDA buffer, which windows stage through pinned host memory: {e.cause}"
            raise e.locate(self.rank, op) from None
        self._staged.setdefault(peer, []).append(staged)
        return host

    def _complete(self, op: str, peer: int | None) -> None:
        """After a flush of `peer` (None: every peer) succeeded: its buffers are let go, and
        its staged gets copied to their CUDA destinations (synchronised) before it returns."""
        if peer is None:
            self._held.clear()
            staged = [s for per_peer in self._staged.values() for s in per_peer]
            self._staged.clear()
        else:
            self._held.pop(peer, None)
            staged = self._staged.pop(peer, ())
        failed = None
        for s in staged:   # every one is finished (its blocks go back) even if one fails
            try:
                s.back()
            except CommError as e:
                failed = failed or e
        if failed is not None:
            raise failed.locate(self.rank, op)

    def _abandon(self, peer: int | None) -> None:
        """A flush failed: the transport may still read or write the pinned copies, so they
        are never reused (as comm.staging does after a failed collective)."""
        for p in list(self._staged) if peer is None else [peer]:
            for s in self._staged.pop(p, ()):
                s.abandon()

    def _failed(self, op: str, e: CommError) -> CommError:
        """A transport failure: the communicator is poisoned as for any other operation."""
        return self._session.failed(op, e)

    def _lean_failed(self, op: str, e: Exception) -> Exception:
        err = self._tw.lean_error(e, op)
        return self._failed(op, err) if isinstance(err, CommError) else err

    # ---- one-sided operations ----------------------------------------------------------------
    def put(self, peer: int, src, offset: int = 0, *, signal: int | None = None) -> None:
        """Copy src's bytes into `peer`'s window at byte `offset` (non-blocking: src must not
        change until flush; a CUDA src is copied to pinned host memory before put returns).
        signal=k: once these bytes and everything this rank put to `peer` before them have
        landed, the peer's counter k goes up by 1."""
        lean = self._put_lean
        if lean is not None and self._session.ok:
            try:
                moved = lean(peer, src, offset, signal)
            except Exception as e:
                raise self._lean_failed("put", e) from None
            if moved > 0:
                return
            if moved == 0:   # in flight: the engine reads src until the flush
                self._held.setdefault(peer, []).append(src)
                return
        op = "put"
        self._usable(op)
        p = self._peer(op, peer)
        buf = self._buffer(op, src, False, "src")
        off = self._range(op, p, offset, buf.nbytes)
        k = -1 if signal is None else self._signal_index(op, signal)
        if buf.device == "cuda":
            buf = self._stage(op, p, buf, "src")
        else:
            self._held.setdefault(p, []).append(buf)
        try:
            self._tw.put(p, buf, off, k)
        except CommError as e:
            raise self._failed(op, e) from None

    def get(self, peer: int, dst, offset: int = 0) -> None:
        """Read len(dst) bytes of `peer`'s window from byte `offset` into dst (non-blocking:
        dst holds them after flush; a CUDA dst is written by that flush, from pinned host
        memory)."""
        lean = self._get_lean
        if lean is not None and self._session.ok:
            try:
                moved = lean(peer, dst, offset)
            except Exception as e:
                raise self._lean_failed("get", e) from None
            if moved > 0:
                return
            if moved == 0:
                self._held.setdefault(peer, []).append(dst)
                return
        op = "get"
        self._usable(op)
        p = self._peer(op, peer)
        buf = self._buffer(op, dst, True, "dst")
        off = self._range(op, p, offset, buf.nbytes)
        if buf.device == "cuda":
            buf = self._stage(op, p, buf, "dst")
        else:
            self._held.setdefault(p, []).append(buf)
        try:
            self._tw.get(p, buf, off)
        except CommError as e:
            raise self._failed(op, e) from None

    def flush(self, peer: int | None = None) -> None:
        """Every put / get this rank issued (to `peer`, or to all) is complete at both ends."""
        lean = self._flush_lean
        if lean is not None and self._session.ok:
            try:
                done = lean(peer)
            except Exception as e:
                self._abandon(None)
                raise self._lean_failed("flush", e) from None
            if done:
                if self._held or self._staged:
                    self._complete("flush", peer)
                return
        op = "flush"
        self._usable(op)
        p = None if peer is None else self._peer(op, peer)
        try:
            self._tw.flush(-1 if p is None else p)
        except CommError as e:
            self._abandon(p)
            raise self._failed(op, e) from None
        self._complete(op, p)

    def wait_signal(self, k: int, value: int, *, timeout: float | None = None) -> None:
        """Block until this rank's counter k is at least `value` (Timeout after `timeout`
        seconds, default the communicator's; a dead peer fails it; Ctrl-C works)."""
        lean = self._wait_lean
        s = self._session
        if lean is not None and timeout is None and s.ok:
            try:
                if lean(k, value, s.timeout):
                    return
            except Exception as e:
                err = self._tw.lean_error(e, "wait_signal")
                if isinstance(err, CommTimeout):   # the caller's to handle, as below
                    raise err.locate(self.rank, "wait_signal") from None
                raise self._lean_failed("wait_signal", e) from None
        op = "wait_signal"
        self._usable(op)
        i = self._signal_index(op, k)
        try:
            want = operator.index(value)
        except TypeError:
            raise self._error(op, f"value {value!r} must be an integer") from None
        if not 0 <= want < 2**64:
            raise self._error(op, f"value {value!r} must be in [0, 2**64)")
        t = self._session.timeout if timeout is None else float(timeout)
        if t < 0:
            raise self._error(op, f"timeout {timeout!r} must not be negative")
        try:
            self._tw.wait_signal(i, want, t)
        except CommError as e:
            # a timeout of this wait is the caller's to handle: the communicator stays usable
            if isinstance(e, CommTimeout):
                raise e.locate(self.rank, op) from None
            raise self._failed(op, e) from None

    def signal(self, k: int) -> int:
        """This rank's counter k now."""
        op = "signal"
        self._usable(op)
        return self._tw.signal(self._signal_index(op, k))

    def fence(self) -> None:
        """Collective: every rank's puts and gets are complete everywhere, then a barrier."""
        op = "fence"
        self._usable(op)
        self._collective(op)
        self._complete(op, None)

    def _collective(self, op: str) -> None:
        """The transport's fence, as one collective of the communicator (one at a time)."""
        s = self._session
        if not s.busy.acquire(False):
            raise s.overlap(op)
        try:
            self._tw.fence()
        except CommError as e:
            self._abandon(None)
            raise self._failed(op, e) from None
        finally:
            s.busy.release()

    def close(self) -> None:
        """Collective: fence, then the window is gone (later calls raise Closed). Idempotent."""
        if self._closed:
            return
        op = "window.close"
        if not self._session.ok:  # nothing can reach it any more: just let go
            self._set_closed()
            self._tw.close()
            return
        try:
            self._collective(op)
            self._complete(op, None)
        finally:
            self._set_closed()
            self._tw.close()

    def _set_closed(self) -> None:
        self._closed = True
        self._put_lean = self._get_lean = self._flush_lean = self._wait_lean = None
        self._held.clear()
        self._abandon(None)   # left only where no fence completed them (a failure)
        if self._cuda is not None:
            self._cuda.close()   # the blocks given back; abandoned ones stay allocated
            self._cuda = None
        self._mem = None   # an allocated window's memory goes with the last array over it
