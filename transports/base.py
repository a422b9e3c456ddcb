"""The Transport protocol and the registry.

A transport gets one fully validated operation descriptor (`OpDesc`) per call and returns a
`Request`. `comm.Communicator` does all argument checking; transports assume valid input.
Adding a transport: one module that subclasses `Transport` and calls `register(cls)`, and
its name in `comm.core.config.TRANSPORTS`.
"""
from __future__ import annotations

import abc
import importlib
import os
import time
from typing import ClassVar

import numpy as np

from comm.core import config
from comm.core.buffers import as_buffer
from comm.core.errors import CommError, TransportUnavailable
from comm.core.ops import (DONE, BootstrapContext, CompletedRequest, OpDesc, OpKind,  # noqa: F401
                           Request)  # the protocol's types


class Transport(abc.ABC):
    name: ClassVar[str]
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    # Receives may name no peer (OpDesc.peer -1): matched by the first message of their tag
    # from any rank, whose sender the request's `source` then gives.
    any_source: ClassVar[bool] = False
    # The operations it runs: the v-collectives only where a transport implements them (the
    # communicator refuses the others with TransportUnavailable, before anything is sent).
    kinds: ClassVar[frozenset[OpKind]] = frozenset(OpKind) - {OpKind.ALL_GATHER_V, OpKind.REDUCE_SCATTER_V}
    # Why shrink / grow cannot work on this transport (None: they can). They rebuild the
    # transport over the store for the new group (create), which fits any transport whose
    # connections the store bootstraps; one whose library makes its own groups cannot.
    elastic: ClassVar[str | None] = None
    # True where the transport's library revokes, agrees and shrinks by itself (MPI's ULFM):
    # comm.elastic then calls ulfm_missing(), revoke(), agree() and shrink() below instead of its
    # own agreement over the store, since only the library can make its next communicator.
    ulfm: ClassVar[bool] = False
    # True where post() runs a float32 all_reduce, reduce_scatter, all_gather or v form with
    # OpDesc.wire set compressed itself (the native engine); elsewhere comm.compress builds them
    # from the transport's collectives.
    compressed_wire: ClassVar[bool] = False

    rank: int
    size: int

    @classmethod
    def available(cls) -> str | None:
        """None when the transport can run here, else a one-line reason it cannot."""
        return None

    @classmethod
    @abc.abstractmethod
    def create(cls, ctx: BootstrapContext) -> "Transport": ...

    @abc.abstractmethod
    def post(self, desc: OpDesc, blocking: bool) -> Request: ...

    # The lean path (optional; the native engine's), the contract the communicator codes to:
    #   run_array(busy, kind, x, out, op, root, counts, timeout_s) runs one blocking
    #   all_reduce, broadcast, all_gather, reduce_scatter, all_gather_v, reduce_scatter_v or
    #   all_to_all (the v forms with `counts`, all_to_all with (out_splits, in_splits) or None)
    #   of the caller's own arrays in a single call, holding the communicator's `busy` lock
    #   (taken without blocking), and returns None; or LEAN_BUSY, having done nothing, when
    #   another thread holds the lock; or LEAN_SKIPPED, having done nothing, when its
    #   arguments are not the plain case it checks for itself (the communicator then
    #   validates and posts as usual, naming any problem).
    #   post_array(busy, kind, x, out, op, root, counts, label) is its asynchronous form: it
    #   returns the posted operation's Request (wait(timeout) raises its CommError, named
    #   `label`; test(); source) instead of None, and the caller holds x and out until it ends.
    # Both raise CommError subclasses with rank and op set (a signal handler's exception,
    # Ctrl-C, as it is).
    run_array = None
    post_array = None

    def prepare(self, desc: OpDesc):
        """A persistent form of the validated `desc` (comm.persistent): an object with
        post(desc, blocking) -> Request, and optionally run(busy, timeout_s) (start + wait in
        one call under the `busy` lock as run_array takes it, False when another thread holds
        it) and start(busy) (the non-blocking post under that lock: a request, with
        wait(timeout) and test(), or None when another thread holds it). Each refuses buffers
        changed since set-up with InvalidArgument and raises CommErrors as run_array does.
        None: the communicator re-checks the buffers and posts desc on each start (the default)."""
        return None

    def error(self, e: Exception) -> CommError:
        """The CommError for an exception of this transport's own library that reached the
        communicator (mpi4py's); a transport whose calls raise CommErrors needs no other."""
        if isinstance(e, CommError):
            return e
        raise e

    def window(self, mem, signals: int) -> "TransportWindow":
        """Collective: expose `mem` (a comm.core.buffers.Buffer, host memory, possibly 0 bytes) to
        every peer, with `signals` counters on this rank (comm.window). Every rank calls it."""
        raise TransportUnavailable(f"transport {self.name!r} has no one-sided communication (windows); "
                                   "use the native or ucx transport")

    def window_allocate(self, nbytes: int, signals: int) -> "TransportWindow":
        """Collective: as window(), over `nbytes` bytes (zeroed) the transport allocates, set
        in the returned window's `memory`. This default allocates process memory and exposes
        it with window(); a transport that can share memory between the ranks of a host
        (native: a segment they map) overrides it."""
        memory = np.zeros(nbytes, np.uint8)
        tw = self.window(as_buffer(memory, op="window", writable=True), signals)
        tw.memory = memory
        return tw

    def split(self, color: int, key: int, ctx: BootstrapContext | None) -> "Transport | None":
        """A transport for the sub-group described by ctx (whose store is already scoped).
        Every rank of the parent calls it; ranks that join no group get ctx None (and return
        None), so transports whose split is itself collective (NCCL) can take part."""
        return None if ctx is None else type(self).create(ctx)

    def abort(self) -> None:
        """Fail every pending and future operation now; may be called from any thread."""

    def revoke(self) -> None:
        """abort(), telling the peers it is a revoke where the transport can (comm.elastic)."""
        self.abort()

    def ulfm_missing(self) -> str | None:
        """(ulfm transports) None when this job can revoke, agree and shrink, else what is
        missing and how to get it."""
        return "this transport has no ULFM"

    def agree(self, flag: int, timeout: float) -> tuple[int, list[int]]:
        """(ulfm transports) The AND of the live ranks' flags (ints below 2**62), and the
        ranks the library reports failed."""
        raise NotImplementedError

    def shrink(self, timeout: float) -> tuple["Transport", list[int]]:
        """(ulfm transports) A transport over the live ranks, and their ranks here, in order."""
        raise NotImplementedError

    def dead_peers(self) -> list[int]:
        """Ranks this rank knows first hand to be dead (comm.elastic). Never raises."""
        return []

    def close(self) -> None:
        """Release connections and memory. Idempotent."""

    def forget_after_fork(self) -> None:
        """Called in a child forked from the owning process, which keeps using the transport:
        drop the child's copies of connections without anything the parent or its peers would
        notice (no goodbye, no shutdown, no unlink). The object is never used again here."""


class TransportWindow(abc.ABC):
    """A transport's side of a comm.window.Window. The Window checked every argument (peer a
    rank, offset + bytes inside sizes[peer], signal an index below the window's count) and
    holds the buffers until the flush that ends their operation; the transport trusts that,
    but a target still checks what arrives from the wire (a hostile or buggy peer)."""

    sizes: tuple[int, ...]   # every rank's window in bytes, in rank order
    memory = None            # window_allocate's windows: this rank's memory (numpy uint8)
    # Optional lean calls, which take the caller's objects unchecked and handle the plain case
    # only (numpy / CPU torch arrays, exact ints in range), moving nothing otherwise:
    #   put_lean(peer, src, offset, signal or None) / get_lean(peer, dst, offset) -> 1: done in
    #   the call, 0: in flight (hold the array until the flush), -1: not the plain case;
    #   flush_lean(peer or None) -> True: flushed, False: call flush();
    #   wait_signal_lean(k, value, timeout_s) -> True: waited, False: call wait_signal().
    # Their exceptions go through lean_error(e, op). comm.window tries them first.
    put_lean = get_lean = flush_lean = wait_signal_lean = None

    def lean_error(self, e: BaseException, op: str) -> BaseException:
        """The CommError for an exception of a lean call (others unchanged)."""
        return e

    @abc.abstractmethod
    def put(self, peer: int, src, offset: int, signal: int) -> None:
        """Start copying src (a Buffer) into peer's window at `offset`; signal >= 0: then add
        1 to the peer's counter `signal`, after this and every earlier put to peer landed."""

    @abc.abstractmethod
    def get(self, peer: int, dst, offset: int) -> None:
        """Start reading dst.nbytes bytes of peer's window at `offset` into dst (a Buffer)."""

    @abc.abstractmethod
    def flush(self, peer: int) -> None:
        """Wait (the communicator's timeout) until every put / get to peer (-1: every peer)
        is complete at both ends; raises the CommError of any that failed, naming the peer."""

    @abc.abstractmethod
    def wait_signal(self, k: int, value: int, timeout_s: float) -> None:
        """Block until this rank's counter k >= value: CommTimeout after timeout_s, PeerFailure
        when a peer died, and signals (Ctrl-C) are served while waiting."""

    @abc.abstractmethod
    def signal(self, k: int) -> int:
        """This rank's counter k."""

    @abc.abstractmethod
    def fence(self) -> None:
        """Collective: every rank's puts / gets complete everywhere, then a barrier."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the window: after a fence on every rank, or alone (a failed communicator, a
        `with` block that raised), where it must not wait for any peer. Idempotent."""


def poll_until(done, timeout: float | None, timed_out) -> None:
    """Call done() until it is true, else raise timed_out() after `timeout` seconds.

    For libraries that progress only while someone calls them (MPI's non-blocking
    collectives, NCCL's streams): a waiter that sleeps early stalls its peers' rounds too, so
    it polls, yielding the core, for the first milliseconds, then backs off to sleeps of up
    to 1 ms for long waits. (Not sleep(0) while polling: timer slack makes any sleep ~50 us.)"""
    start = time.monotonic()
    spin_until, pause = start + 5e-3, 10e-6
    while not done():
        now = time.monotonic()
        if timeout is not None and now - start > timeout:
            raise timed_out()
        if now < spin_until:
            os.sched_yield()
        else:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


_REGISTRY: dict[str, type[Transport]] = {}
_MODULES = {name: f"transports.{name}" for name in config.TRANSPORTS}


def register(cls: type[Transport]) -> type[Transport]:
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    """Every transport name this library knows, available here or not."""
    return list(_MODULES)


def get(name: str) -> type[Transport]:
    """The transport class registered as `name`, importing its module on first use."""
    if name not in _REGISTRY:
        module = _MODULES.get(name)
        if module is None:
            raise TransportUnavailable(f"unknown transport {name!r}; known: {', '.join(_MODULES)}")
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as e:   # OSError: a shared library that will not load
            raise TransportUnavailable(f"transport {name!r} cannot be imported: {e}") from None
    return _REGISTRY[name]


def unavailable_reason(name: str) -> str | None:
    """None when transport `name` can run here, else why not (one line)."""
    try:
        return get(name).available()
    except CommError as e:
        return e.cause
