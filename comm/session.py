"""Session: a communicator's state and its posting machinery, the one interface that comm's
features (work, persistent, v-collectives, windows, elastic, compress, moe, torch) use.

Communicator.session is one; it is for comm's own modules, not user API. A Session holds what
a communicator is made of (its transport, bootstrap context, one-collective-at-a-time lock,
flight recorder, CUDA stager) and what happened to it (the first failure, closed, disowned in
a forked child), and posts operations: post() for an OpDesc, lean() for the transport's lean
path (transports/base.py), outcome() / orphan() / reap() for what a Work waits on or drops.

A transport failure (dead peer, timeout, mismatch, abort) poisons the session: later calls
fail at once with the original cause (refuse) instead of hanging. Bad input does not.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
import weakref
from typing import NoReturn

from .core.errors import (Aborted, Closed, CommError, CommTimeout, InvalidArgument, PeerFailure,
                          Revoked)
from .core.ops import DONE, LEAN_BUSY, BootstrapContext, OpDesc
from .flight_recorder import FlightRecorder
from .work import Work

try:   # the engine's lean calls take this lock natively (threading.Lock's acquire is a Python call)
    from ._native import BusyLock as _BusyLock
except ImportError:   # the extension was not built: the other transports still run
    _BusyLock = threading.Lock

SKIPPED = object()   # lean(): the lean path did not take the call


class Session:
    """One communicator's state and posting (see the module docstring)."""

    def __init__(self, transport, ctx: BootstrapContext, owned_store=None):
        self.transport = transport
        self.ctx = ctx
        self.rank, self.size, self.timeout = ctx.rank, ctx.size, ctx.timeout
        self.owned_store = owned_store   # the world's store connection, closed with it
        self.busy = _BusyLock()   # held by the thread inside a collective
        self.recorder = FlightRecorder(ctx.rank, ctx.group_name, getattr(transport, "recent_ops", None))
        self.stager = None   # a comm.staging.Stager once a CUDA buffer meets a CPU-only transport
        self._failure: CommError | None = None
        self.closed = False
        self.foreign = False   # disowned: this process is a forked child of the owner
        self.ok = True   # neither failed nor closed: the hot paths' one test
        self._pid = os.getpid()
        self._next_seq = itertools.count(1).__next__   # atomic under the GIL
        # what comm.elastic and split keep per communicator
        self.failed_ranks: list[int] = []   # as the latest agree() or shrink() found them
        self.elastic_calls = 0   # agree / shrink / grow so far: names each one alike on every rank
        self.split_count = 0
        # (request, label, buffers, recorder line) of Works dropped before their operation
        # ended: the transport may still read or write those buffers, so they are held here
        # until the operation is seen to end (reap, at each post and at close). A deque:
        # append and popleft are atomic, from any thread or a garbage collection.
        self.orphans: collections.deque = collections.deque()
        self._reap_every = self._reap_in = 1   # posts between looks at the orphans (see reap)
        weakref.finalize(self, _ABANDONED.extend, self.orphans)
        self.run_array = transport.run_array   # the lean path; None: every call takes the full path
        self.post_array = transport.post_array   # its async form
        _LIVE.add(self)

    # ---- state -------------------------------------------------------------------------------
    @property
    def failure(self) -> CommError | None:
        """The error that poisoned this communicator (None: it has not failed)."""
        return self._failure

    def fail(self, error: CommError) -> None:
        """Poison with `error` unless already failed (the first cause is the one reported)."""
        if self._failure is None:
            self._failure = error
        self.ok = False

    def revoke(self, error: Revoked) -> None:
        """Revoked (comm.elastic): replaces an earlier failure, so later calls say revoked."""
        if not isinstance(self._failure, Revoked):
            self._failure = error
        self.ok = False

    def usable(self, op: str) -> None:
        """Refuse `op` on a failed, closed or disowned communicator."""
        if not self.ok:
            self.refuse(op)

    def refuse(self, op: str) -> NoReturn:
        """Raise the error of a call on a failed, closed or disowned communicator."""
        if self.foreign:
            raise CommError(self._failure.cause, rank=self.rank, op=op)
        if self.closed:
            raise Closed("the communicator is closed", rank=self.rank, op=op)
        if isinstance(self._failure, Revoked):
            raise Revoked(f"the communicator was revoked ({self._failure.cause})", rank=self.rank, op=op)
        raise Aborted(f"the communicator failed earlier and takes no more work ({self._failure.cause}); "
                      "create a new one", rank=self.rank, op=op)

    def invalid(self, op: str, cause: str) -> InvalidArgument:
        """The error of an argument this rank refuses (the communicator stays usable)."""
        return InvalidArgument(cause, rank=self.rank, op=op)

    def overlap(self, op: str) -> InvalidArgument:
        """A second thread entered a collective while another is inside one. Refused, and the
        communicator is aborted on every rank: the two threads' calls may already have run in
        different orders on different ranks, and same-signature collectives would then swap
        their data silently."""
        err = InvalidArgument(
            "another thread is inside a collective on this communicator; a communicator runs one "
            "collective at a time, posted in the same order on every rank, so it is now aborted. "
            "Call collectives from one thread, or give each thread its own communicator (split)",
            rank=self.rank, op=op)
        self.fail(err)
        self.transport.abort()
        return err

    def failed(self, op: str | None, err: CommError, entry=None) -> CommError:
        """Give `err` this rank and op; unless it is bad input, poison the communicator, mark
        the recorder's line `entry` failed and dump the recorder on a timeout or dead peer."""
        err.locate(self.rank, op)
        if not isinstance(err, InvalidArgument):
            self.fail(err)
            if entry is not None:
                entry[5] = "failed"
            if isinstance(err, (CommTimeout, PeerFailure)):
                self.recorder.dump(str(err))
        return err

    def interrupted(self, exc: BaseException, entry) -> None:
        """A signal handler raised `exc` while this rank waited: the operation is half done, so
        the communicator is aborted (its peers fail at once instead of waiting for this rank)."""
        if entry is not None:
            entry[5] = "failed"
        self.fail(Aborted(f"interrupted by {type(exc).__name__} during an operation", rank=self.rank, op="abort"))
        self.transport.abort()

    def abort(self) -> None:
        """Fail every pending and future operation at once (any thread may call it)."""
        if self.foreign:
            self.refuse("abort")  # aborting would cut the parent's connections
        self.fail(Aborted("aborted by the user", rank=self.rank, op="abort"))
        self.transport.abort()

    def disown(self) -> None:
        """In a child forked from the owner: refuse every later call, and let the transport drop
        the child's copies of its connections (the parent keeps using them)."""
        self.foreign, self.ok = True, False
        self._failure = CommError(
            f"this communicator belongs to pid {self._pid}, which forked this process (pid "
            f"{os.getpid()}); a forked child cannot use its parent's communicators: call comm.init() "
            "in the child", rank=self.rank)
        self.transport.forget_after_fork()

    def close(self, first=None) -> None:
        """Release connections and shared memory (idempotent). `first()` runs once the session
        is closed and before the transport goes (the owner's sub-communicators)."""
        if self.closed:
            return
        self.closed, self.ok = True, False
        if self.foreign:
            return  # the parent's to close; the child's copies went at fork
        if first is not None:
            first()
        self.transport.close()
        self.reap(len(self.orphans))  # ended now, unless the transport lets them outlive close()
        if self.stager is not None:
            self.stager.close()
        if self.owned_store is not None:
            self.owned_store.close()

    def staging(self, op: str):
        """The Stager that carries CUDA data through pinned host memory (made on first use)."""
        if self.stager is None:
            from .staging import Stager
            try:
                self.stager = Stager(self.transport.post, f"the {self.transport.name} transport")
            except CommError as e:
                raise self.invalid(op, f"CUDA buffer on the {self.transport.name} transport: {e.cause}") from None
        return self.stager

    def child_context(self, ranks, scope: str, group_name: str) -> BootstrapContext:
        """The bootstrap context of a group of `ranks` (numbered as here, this rank among them)
        made from this communicator (split, and shrink where the library makes the group): the
        store's view under `scope`, the members' host ids."""
        ctx, rank = self.ctx, ranks.index(self.rank)
        return BootstrapContext(rank, len(ranks), ctx.store.scoped(scope, rank, len(ranks)), self.timeout,
                                ctx.host_id, ctx.secret, ctx.bind_addr, group_name, ctx.options,
                                tuple(ctx.host_ids[r] for r in ranks) if ctx.host_ids else ())

    # ---- posting -----------------------------------------------------------------------------
    def post(self, desc: OpDesc, async_op: bool, via=None, exclusive: bool = True):
        """Post desc to the transport (or to `via`, a persistent op prepared from it); None
        once done, or its Work with async_op. exclusive: a collective, which no other thread
        may be posting or running at the same time (point-to-point calls pass False: they
        match by peer and tag, not by order)."""
        if self.orphans:
            self.reap_soon()
        if not self.ok:
            self.refuse(desc.kind.label)
        if exclusive and not self.busy.acquire(False):
            raise self.overlap(desc.kind.label)
        try:
            desc.seq = self._next_seq()
            entry = self.recorder.posted(desc)
            try:
                if via is not None:
                    req = via.post(desc, not async_op)
                elif self.stager is not None and self.stager.involves(desc):
                    req = self.stager.post(desc, not async_op)
                else:
                    req = self.transport.post(desc, not async_op)
                if not async_op and req is not DONE:
                    req.wait(self.timeout)
            except CommError as e:
                raise self.failed(desc.kind.label, e, entry) from None
            except BaseException as e:  # Ctrl-C, or another signal handler's exception
                self.interrupted(e, entry)
                raise
        finally:
            if exclusive:
                self.busy.release()
        if async_op:
            return Work(self, req, desc.kind.label, desc, entry)
        entry[5] = "done"
        return None

    def lean(self, kind: int, label: str, x, out, op, root, counts, async_op: bool):
        """The transport's lean path for one call (transports/base.py): None when it ran, a
        Work when posted, SKIPPED when it does not take these arguments (the caller then takes
        the full path, whose checks name any problem). Communicator.all_reduce inlines the
        blocking form: it is the latency path, and a Python frame is a tenth of its cost."""
        run = self.run_array
        if run is None or not self.ok:
            return SKIPPED
        if self.orphans:
            self.reap_soon()
        try:
            done = (self.post_array(self.busy, kind, x, out, op, root, counts, label) if async_op
                    else run(self.busy, kind, x, out, op, root, counts, self.timeout))
        except BaseException as e:
            raise self.lean_error(label, e) from None
        if done is None:
            return None
        if type(done) is int:
            if done == LEAN_BUSY:
                raise self.overlap(label)
            return SKIPPED
        return Work(self, done, label, (x, out), None)

    def lean_error(self, op: str, e: BaseException) -> BaseException:
        """The exception to raise for `e`, raised by a lean call or a persistent run (which
        hold `busy` as post does): a signal handler's (Ctrl-C) aborts, as in post."""
        if not isinstance(e, Exception):
            self.interrupted(e, None)
            return e
        if not self.ok:  # failed or closed meanwhile (abort)
            try:
                self.refuse(op)
            except CommError as refused:
                return refused
        if not isinstance(e, CommError):   # a bug, not a failure of the transport: as it is
            return e
        return self.failed(op, e)

    def outcome(self, req, label: str, entry, timeout: float) -> CommError | None:
        """Wait for a request; None, or the CommError it ended with (poisoned, as post does)."""
        try:
            req.wait(timeout)
        except CommError as e:
            return self.failed(label, e, entry)
        if entry is not None:
            entry[5] = "done"
        return None

    def orphan(self, req, label: str, keep, entry) -> None:
        """A Work (or a started persistent op) dropped before its operation ended: the
        transport may still use the buffers `keep` holds, so they stay here until it ends."""
        self.orphans.append((req, label, keep, entry))

    def reap_soon(self) -> None:
        self._reap_in -= 1
        if self._reap_in <= 0:
            self.reap()

    def reap(self, most: int = 4) -> None:
        """Let go of dropped Works' buffers whose operations have ended, looking at the `most`
        oldest; a failure among them poisons the communicator as a waited one would. While
        none ends, the posts between looks double (up to 1024): thousands of dropped receives
        that never match then cost a post nothing (looking at 4 of them costs microseconds)."""
        released = False
        for _ in range(min(len(self.orphans), most)):
            try:
                orphan = self.orphans.popleft()
            except IndexError:  # another thread (point-to-point calls) took the rest
                return
            req, label, _, entry = orphan
            try:
                if not req.test():
                    self.orphans.append(orphan)
                    continue
            except CommError as e:
                self.failed(label, e, entry)
            else:
                self.outcome(req, label, entry, 0)
            released = True
        self._reap_every = 1 if released else min(2 * self._reap_every, 1024)
        self._reap_in = self._reap_every


# Buffers of operations still running when their communicator was collected without close():
# kept for the life of the process, since nothing can tell any more when the transport is
# done with them. A leak, bounded by that mistake, instead of memory written after its free.
_ABANDONED: list = []

# Every session of this process, so a forked child can disown them all.
_LIVE: "weakref.WeakSet[Session]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for s in list(_LIVE):
        s.disown()


os.register_at_fork(after_in_child=_after_fork_in_child)
