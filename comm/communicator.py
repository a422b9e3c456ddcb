"""Communicator: checks every argument (comm.checks), builds one OpDesc, posts it through its
Session (comm.session), the communicator's state and posting, which the features share.

The common call (a blocking all_reduce or broadcast of one plain array with a built-in op)
first tries the transport's lean path, where it has one: a single native call that checks
the array itself and builds no Python objects; anything it does not take comes back here
for the full checks. Nothing here knows a transport's details. Bad input is refused on the caller's rank with
InvalidArgument before anything is sent, and the communicator stays usable afterwards; a
transport failure (dead peer, timeout, mismatch, abort) poisons the communicator, so later
calls fail at once with the original cause instead of hanging.
"""
from __future__ import annotations

import operator
import struct

import numpy as np

from . import checks, elastic, vcollectives
from . import compress as compression
from .bootstrap import auth, limits, rendezvous
from .bootstrap.topology import Topology
from .core import config, log
from .core.buffers import Buffer, as_buffer
from .core.errors import CommError, InvalidArgument, TransportUnavailable, _integer, from_os_error
from .core.ops import LEAN_BUSY, BootstrapContext, OpDesc, OpKind
from .core.types import ReduceOp
from .persistent import Persistent
from .session import SKIPPED, Session
from .window import MAX_SIGNALS, Window
from .work import Work

SUM = ReduceOp.SUM
_ALL_REDUCE, _BROADCAST = int(OpKind.ALL_REDUCE), int(OpKind.BROADCAST)  # plain ints: no enum lookups
_ALL_GATHER, _REDUCE_SCATTER = int(OpKind.ALL_GATHER), int(OpKind.REDUCE_SCATTER)
_ALL_GATHER_V, _REDUCE_SCATTER_V = int(OpKind.ALL_GATHER_V), int(OpKind.REDUCE_SCATTER_V)
_ALL_TO_ALL = int(OpKind.ALL_TO_ALL)


class Communicator:
    """A group of ranks and the transport that connects them. Create with comm.init()."""

    def __init__(self, transport, ctx: BootstrapContext, *, owned_store=None,
                 ranks: tuple[int, ...] | None = None):
        # For comm's own features (work, persistent, windows, elastic, compress, torch); not
        # user API: the communicator's state and posting (comm/session.py).
        self.session = Session(transport, ctx, owned_store)
        self.rank = ctx.rank
        self.size = ctx.size
        self.timeout = ctx.timeout
        self.transport = transport.name
        # the job's numbering of the members (world ranks; comm.elastic gives newcomers the next)
        self.ranks = ranks if ranks is not None else tuple(range(ctx.size))
        self.epoch = 0   # shrink and grow number their communicators on from their parent's
        self.topology = Topology.from_host_ids(ctx.host_ids or [ctx.host_id] * ctx.size, ctx.rank)
        log.debug(ctx.rank, f"{ctx.group_name}: topology {self.topology}")

    def __repr__(self) -> str:
        return (f"<comm.Communicator rank {self.rank} of {self.size} on {self.transport} "
                f"({self.session.ctx.group_name})>")

    # ---- context manager -------------------------------------------------------------------
    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, x, op=SUM, *, out=None, scale: float | None = None, async_op: bool = False,
                   compress: str | None = None):
        """Reduce x over all ranks; the result lands in x (or in `out`, leaving x untouched).
        compress="bf16" / "fp8": fewer bits between hosts, float32 sums (comm.compress)."""
        if compress is not None:
            return compression.run(self, self._all_reduce(x, op, out, scale), compress, async_op)
        s = self.session
        if scale is None:   # the latency path: Session.lean inlined, no Python frame of its own
            lean = s.run_array
            if lean is not None and s.ok:
                if s.orphans:
                    s.reap_soon()
                try:
                    done = (s.post_array(s.busy, _ALL_REDUCE, x, out, op, None, None, "all_reduce") if async_op
                            else lean(s.busy, _ALL_REDUCE, x, out, op, None, None, s.timeout))
                except BaseException as e:
                    raise s.lean_error("all_reduce", e) from None
                if done is None:
                    return None
                if type(done) is not int:
                    return Work(s, done, "all_reduce", (x, out), None)
                if done == LEAN_BUSY:
                    raise s.overlap("all_reduce")
        return s.post(self._all_reduce(x, op, out, scale), async_op)

    def all_reduce_init(self, x, op=SUM, *, out=None, scale: float | None = None,
                        compress: str | None = None) -> Persistent:
        """A persistent all_reduce of x: checked once, then h() (or h.start(); h.wait()) runs it."""
        return self._persistent(self._all_reduce(x, op, out, scale), compress)

    def _persistent(self, desc: OpDesc, compress: str | None):
        return Persistent(self.session, desc) if compress is None else compression.Persistent(self, desc, compress)

    def _all_reduce(self, x, op, out, scale) -> OpDesc:
        s = self.session
        name = "all_reduce"
        send = checks.buffer(s, x, name, writable=out is None, what="input")
        recv = send
        if out is not None:
            recv = checks.buffer(s, out, name, writable=True, what="output")
            checks.same_type(s, name, send, recv)
            checks.count_match(s, name, recv.count, send.count, "output")
            checks.apart(s, name, send, recv, 0, "in place, out is x itself")
        rop, factor = checks.reduce_op(s, name, op, send, scale)
        return OpDesc(OpKind.ALL_REDUCE, send, recv, send.dtype, send.count, rop, factor)

    def reduce_scatter(self, out, x, op=SUM, *, scale: float | None = None, async_op: bool = False,
                       compress: str | None = None):
        """Reduce x (size * len(out) elements) over all ranks; rank r gets block r in `out`."""
        s = self.session
        if compress is not None:
            return compression.run(self, self._reduce_scatter(out, x, op, scale), compress, async_op)
        if scale is None:
            done = s.lean(_REDUCE_SCATTER, "reduce_scatter", x, out, op, None, None, async_op)
            if done is not SKIPPED:
                return done
        return s.post(self._reduce_scatter(out, x, op, scale), async_op)

    def reduce_scatter_init(self, out, x, op=SUM, *, scale: float | None = None,
                            compress: str | None = None) -> Persistent:
        """A persistent reduce_scatter (see all_reduce_init)."""
        return self._persistent(self._reduce_scatter(out, x, op, scale), compress)

    def _reduce_scatter(self, out, x, op, scale) -> OpDesc:
        s = self.session
        name = "reduce_scatter"
        send = checks.buffer(s, x, name, writable=False, what="input")
        recv = checks.buffer(s, out, name, writable=True, what="output")
        checks.same_type(s, name, send, recv)
        checks.count_match(s, name, send.count, recv.count * self.size, "input")
        checks.apart(s, name, recv, send, self.rank * recv.nbytes, f"in place, out is block {self.rank} of x")
        rop, factor = checks.reduce_op(s, name, op, send, scale)
        return OpDesc(OpKind.REDUCE_SCATTER, send, recv, send.dtype, recv.count, rop, factor)

    def all_gather(self, out, x, *, async_op: bool = False, compress: str | None = None):
        """Concatenate every rank's x, in rank order, into `out` (size * len(x) elements)."""
        s = self.session
        if compress is not None:
            return compression.run(self, self._all_gather(out, x), compress, async_op)
        done = s.lean(_ALL_GATHER, "all_gather", x, out, None, None, None, async_op)
        if done is not SKIPPED:
            return done
        return s.post(self._all_gather(out, x), async_op)

    def all_gather_init(self, out, x, *, compress: str | None = None) -> Persistent:
        """A persistent all_gather (see all_reduce_init)."""
        return self._persistent(self._all_gather(out, x), compress)

    def _all_gather(self, out, x) -> OpDesc:
        s = self.session
        name = "all_gather"
        send = checks.buffer(s, x, name, writable=False, what="input")
        recv = checks.buffer(s, out, name, writable=True, what="output")
        checks.same_type(s, name, send, recv)
        checks.count_match(s, name, recv.count, send.count * self.size, "output")
        checks.apart(s, name, send, recv, self.rank * send.nbytes, f"in place, x is block {self.rank} of out")
        return OpDesc(OpKind.ALL_GATHER, send, recv, send.dtype, send.count)

    def all_gather_v(self, out, x, counts, *, async_op: bool = False, compress: str | None = None):
        """Blocks of any size: rank r's x (counts[r] rows) lands at rows sum(counts[:r]) of `out`
        on every rank (MPI's Allgatherv). counts: the same list on every rank; zeros allowed."""
        s = self.session
        if compress is not None:
            return compression.run(self, vcollectives.all_gather_v(s, out, x, counts), compress, async_op)
        done = s.lean(_ALL_GATHER_V, "all_gather_v", x, out, None, None, counts, async_op)
        if done is not SKIPPED:
            return done
        return s.post(vcollectives.all_gather_v(s, out, x, counts), async_op)

    def all_gather_v_init(self, out, x, counts, *, compress: str | None = None) -> Persistent:
        """A persistent all_gather_v (see all_reduce_init)."""
        return self._persistent(vcollectives.all_gather_v(self.session, out, x, counts), compress)

    def reduce_scatter_v(self, out, x, counts, op=SUM, *, scale: float | None = None, async_op: bool = False,
                         compress: str | None = None):
        """Reduce x (sum(counts) rows) over all ranks; rank r gets rows sum(counts[:r]) ..
        sum(counts[:r+1]) in `out` (counts[r] rows; MPI's Reduce_scatter)."""
        s = self.session
        if compress is not None:
            return compression.run(self, vcollectives.reduce_scatter_v(s, out, x, counts, op, scale),
                                   compress, async_op)
        if scale is None:
            done = s.lean(_REDUCE_SCATTER_V, "reduce_scatter_v", x, out, op, None, counts, async_op)
            if done is not SKIPPED:
                return done
        return s.post(vcollectives.reduce_scatter_v(s, out, x, counts, op, scale), async_op)

    def reduce_scatter_v_init(self, out, x, counts, op=SUM, *, scale: float | None = None,
                              compress: str | None = None) -> Persistent:
        """A persistent reduce_scatter_v (see all_reduce_init)."""
        return self._persistent(vcollectives.reduce_scatter_v(self.session, out, x, counts, op, scale), compress)

    def broadcast(self, x, root: int = 0, *, async_op: bool = False):
        """Copy root's x into x on every rank."""
        s = self.session
        done = s.lean(_BROADCAST, "broadcast", x, None, 0, root, None, async_op)
        if done is not SKIPPED:
            return done
        return s.post(self._broadcast(x, root), async_op)

    def broadcast_init(self, x, root: int = 0) -> Persistent:
        """A persistent broadcast (see all_reduce_init)."""
        return Persistent(self.session, self._broadcast(x, root))

    def _broadcast(self, x, root) -> OpDesc:
        s = self.session
        name = "broadcast"
        buf = checks.buffer(s, x, name, writable=True, what="buffer")
        root = checks.root(s, name, root)
        return OpDesc(OpKind.BROADCAST, buf, buf, buf.dtype, buf.count, root=root)

    def reduce(self, x, root: int = 0, op=SUM, *, out=None, scale: float | None = None, async_op: bool = False):
        """Reduce x over all ranks into root's x (or root's `out`); other ranks' buffers are untouched."""
        s = self.session
        name = "reduce"
        root = checks.root(s, name, root)
        send = checks.buffer(s, x, name, writable=out is None and self.rank == root, what="input")
        recv = None
        if self.rank == root:
            recv = send if out is None else checks.buffer(s, out, name, writable=True, what="output")
            checks.same_type(s, name, send, recv)
            checks.count_match(s, name, recv.count, send.count, "output")
            checks.apart(s, name, send, recv, 0, "in place, out is x itself")
        rop, factor = checks.reduce_op(s, name, op, send, scale)
        return s.post(OpDesc(OpKind.REDUCE, send, recv, send.dtype, send.count, rop, factor, root), async_op)

    def gather(self, out, x, root: int = 0, *, async_op: bool = False):
        """Concatenate every rank's x into root's `out` (other ranks may pass out=None)."""
        s = self.session
        name = "gather"
        root = checks.root(s, name, root)
        send = checks.buffer(s, x, name, writable=False, what="input")
        recv = None
        if self.rank == root:
            recv = checks.buffer(s, out, name, writable=True, what="output")
            checks.same_type(s, name, send, recv)
            checks.count_match(s, name, recv.count, send.count * self.size, "output")
            checks.apart(s, name, send, recv, root * send.nbytes, f"in place, x is block {root} of out")
        return s.post(OpDesc(OpKind.GATHER, send, recv, send.dtype, send.count, root=root), async_op)

    def scatter(self, out, x, root: int = 0, *, async_op: bool = False):
        """Block r of root's x (size * len(out) elements) goes to rank r's `out`; non-roots pass x=None."""
        s = self.session
        name = "scatter"
        root = checks.root(s, name, root)
        recv = checks.buffer(s, out, name, writable=True, what="output")
        send = None
        if self.rank == root:
            send = checks.buffer(s, x, name, writable=False, what="input")
            checks.same_type(s, name, send, recv)
            checks.count_match(s, name, send.count, recv.count * self.size, "input")
            checks.apart(s, name, recv, send, root * recv.nbytes, f"in place, out is block {root} of x")
        return s.post(OpDesc(OpKind.SCATTER, send, recv, recv.dtype, recv.count, root=root), async_op)

    def all_to_all(self, out, x, out_splits=None, in_splits=None, *, async_op: bool = False):
        """Rank r sends in_splits[j] rows of x to rank j and receives out_splits[j] rows from rank j,
        packed in rank order (torch's all_to_all_single). Without splits: equal blocks."""
        s = self.session
        splits = None if in_splits is None and out_splits is None else (out_splits, in_splits)
        done = s.lean(_ALL_TO_ALL, "all_to_all", x, out, None, None, splits, async_op)
        if done is not SKIPPED:
            return done
        return s.post(self._all_to_all(out, x, out_splits, in_splits), async_op)

    def all_to_all_init(self, out, x, out_splits=None, in_splits=None) -> Persistent:
        """A persistent all_to_all with these (fixed) splits (see all_reduce_init)."""
        return Persistent(self.session, self._all_to_all(out, x, out_splits, in_splits))

    def _all_to_all(self, out, x, out_splits, in_splits) -> OpDesc:
        s = self.session
        name = "all_to_all"
        send = checks.buffer(s, x, name, writable=False, what="input")
        recv = checks.buffer(s, out, name, writable=True, what="output")
        checks.same_type(s, name, send, recv)
        checks.same_rows(s, name, send, recv)
        send_counts = checks.splits(s, name, send, in_splits, "input")
        recv_counts = checks.splits(s, name, recv, out_splits, "output")
        if in_splits is None and out_splits is None:
            checks.count_match(s, name, recv.count, send.count, "output")
        if send_counts[self.rank] != recv_counts[self.rank]:  # the block a rank keeps is copied
            raise s.invalid(name, f"in_splits[{self.rank}] and out_splits[{self.rank}] differ: "
                            "the rows a rank sends itself must equal the rows it expects")
        checks.apart(s, name, send, recv, None)
        return OpDesc(OpKind.ALL_TO_ALL, send, recv, send.dtype, send.count,
                      send_counts=send_counts, recv_counts=recv_counts)

    def barrier(self, *, async_op: bool = False):
        """Return once every rank has entered the barrier."""
        return self.session.post(OpDesc(OpKind.BARRIER), async_op)

    # ---- point to point ----------------------------------------------------------------------
    def _p2p(self, kind: OpKind, x, peer: int, tag: int, async_op: bool):
        s = self.session
        name = kind.label
        buf = checks.buffer(s, x, name, writable=kind is OpKind.RECV, what="buffer")
        if peer is None and kind is OpKind.RECV:   # from any rank
            if not s.transport.any_source:
                raise s.invalid(name, f"transport {self.transport!r} cannot receive from any rank; pass src")
            peer = -1
        else:
            peer = checks.root(s, name, peer, "dst" if kind is OpKind.SEND else "src")
        if peer == self.rank:
            raise s.invalid(name, "cannot send to or receive from itself")
        try:
            tag_value = operator.index(tag)
        except TypeError:
            tag_value = -1
        if not 0 <= tag_value < 2**31:
            raise s.invalid(name, f"tag {tag!r} must be an integer in [0, 2**31)")
        desc = OpDesc(kind, buf if kind is OpKind.SEND else None, buf if kind is OpKind.RECV else None,
                      buf.dtype, buf.count, peer=peer, tag=tag_value)
        return s.post(desc, async_op, exclusive=False)

    def send(self, x, dst: int, tag: int = 0) -> None:
        """Send x to rank dst; returns when x may be reused."""
        self._p2p(OpKind.SEND, x, dst, tag, False)

    def recv(self, x, src: int | None, tag: int = 0) -> int:
        """Receive into x from rank src (x must have the sender's element count); src=None takes
        the first message with this tag from any rank. Returns the sender's rank."""
        if src is None:  # the sender is only known from the request
            work = self._p2p(OpKind.RECV, x, None, tag, True)
            work.wait()
            return work.source
        self._p2p(OpKind.RECV, x, src, tag, False)
        return src

    def isend(self, x, dst: int, tag: int = 0) -> Work:
        return self._p2p(OpKind.SEND, x, dst, tag, True)

    def irecv(self, x, src: int | None, tag: int = 0) -> Work:
        """As recv, returning at once; with src=None, the Work's `source` names the sender."""
        return self._p2p(OpKind.RECV, x, src, tag, True)

    def batch_p2p(self, ops) -> list[Work]:
        """Post many comm.P2POp (isend / irecv) at once; any order completes. Returns their Works."""
        from .p2p import batch_p2p
        return batch_p2p(self, ops)

    # ---- one-sided -----------------------------------------------------------------------------
    def window(self, buf, *, signals: int = 64) -> Window:
        """Collective: a window on every rank for put / get, with `signals` counters on each
        rank (comm.window.Window). `buf` is this rank's window: an array (host memory) to
        expose, or an int, a number of bytes the library allocates (as MPI_Win_allocate: the
        ranks of a host map each other's, so a put between them is a memcpy; w.buffer is the
        memory, zeroed). Sizes may differ per rank, 0 bytes too; ranks may mix both forms.
        Device memory is refused (InvalidArgument): put from and get into CUDA buffers
        instead, which the window stages through pinned host memory.
        Arguments one rank refuses are every rank's InvalidArgument, at once."""
        s = self.session
        name = "window"
        if not s.ok:
            s.refuse(name)
        nbytes, mem, count, cause = None, None, -1, None
        try:
            nbytes, mem = self._window_memory(buf, name)
            count = _integer(signals)
        except InvalidArgument as e:
            cause = e.cause
        except TypeError:
            pass
        if cause is None and not 0 <= count <= MAX_SIGNALS:
            cause = f"signals={signals!r} must be an integer in [0, {MAX_SIGNALS}]"
        self._agree_arguments(name, cause)
        if not s.busy.acquire(False):
            raise s.overlap(name)
        try:
            if nbytes is None:
                tw = s.transport.window(mem, count)
            else:
                tw = s.transport.window_allocate(nbytes, count)
                mem = as_buffer(tw.memory, op=name, writable=True)
        except CommError as e:
            if isinstance(e, TransportUnavailable):
                raise e.locate(self.rank, name) from None
            raise s.failed(name, e) from None
        finally:
            s.busy.release()
        return Window(s, tw, mem, count)

    def _window_memory(self, buf, name: str) -> tuple[int | None, Buffer | None]:
        """(nbytes, None) for memory the library allocates, (None, buffer) for an array."""
        s = self.session
        if isinstance(buf, (bool, np.bool_)) or isinstance(buf, (float, np.floating)):
            raise s.invalid(name, f"nbytes={buf!r} must be an int (or pass an array to expose)")
        if isinstance(buf, (int, np.integer)):
            nbytes = int(buf)
            if nbytes < 0:
                raise s.invalid(name, f"nbytes={buf!r} must not be negative")
            # Shared memory is not overcommitted: pages past what the host has would bring
            # the kernel's OOM killer onto whatever process it picks, not fail this call.
            have = limits.available_memory()
            if have is not None and nbytes > have:
                raise s.invalid(name, f"nbytes={nbytes} is more than this host's available memory "
                                f"({have} bytes: MemAvailable and free huge pages)")
            return nbytes, None
        # read here, not by checks.buffer: a CUDA window must not start the collectives' staging
        try:
            mem = as_buffer(buf, op=name, writable=True)
        except InvalidArgument as e:
            raise s.invalid(name, f"window: {e.cause}") from None
        if mem.device != "cpu":
            # Every engine channel writes into the window from host code (memcpy, CMA, the
            # target's engine); no transport here reaches device memory, and a host shadow of
            # it would be stale between a peer's put and any GPU read.
            cuda = ", and put from / get into CUDA buffers, which windows stage through pinned host memory" \
                if mem.device == "cuda" else ""
            raise s.invalid(name, f"the window is on {mem.device}; windows expose host memory: pass a host "
                            "array (pinned for fast copies to and from a GPU, e.g. torch.empty(n, "
                            f"dtype=torch.uint8, pin_memory=True)) or c.window(nbytes){cuda}")
        return None, mem

    def _agree_arguments(self, op: str, cause: str | None) -> None:
        """Collective, for set-up calls whose ranks pass different arguments (windows): a rank
        that refuses its own makes every rank raise, rather than leave the others waiting in
        the exchange until the timeout. One 8-byte all_reduce."""
        s = self.session
        first = np.array([self.rank if cause else self.size], np.int64)
        # a transport of device memory only (nccl) has no windows and refuses them itself
        if self.size > 1 and "cpu" in s.transport.devices:
            self.all_reduce(first, ReduceOp.MIN)
        if cause is not None:
            raise s.invalid(op, cause)
        if first[0] < self.size:
            raise s.invalid(op, f"rank {int(first[0])} refused its arguments (its own error says why); "
                            "no rank made the window")

    # ---- groups and lifetime -----------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> "Communicator | None":
        """Collective over this group: ranks with equal color form a new communicator, ordered by
        (key, rank). color=None (or negative) takes part without joining; it gets None."""
        s = self.session
        if not s.ok:
            s.refuse("split")
        if not s.busy.acquire(False):
            raise s.overlap("split")
        try:
            return self._split(color, key)
        finally:
            s.busy.release()

    def _split(self, color: int | None, key: int | None) -> "Communicator | None":
        """split's exchange and set-up, under the busy lock split holds."""
        s = self.session
        color = -1 if color is None else int(color)
        key = self.rank if key is None else int(key)
        s.split_count += 1
        tag = f"split{s.split_count}"
        entries = [struct.unpack("!qq", v) for v in s.ctx.store.all_gather(tag, struct.pack("!qq", color, key))]
        if color < 0:
            _set_up(self.rank, "split", s.transport.split, -1, key, None)
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(entries) if c == color)
        ranks = tuple(r for _, r in members)
        ctx = s.child_context(ranks, f"{tag}/c{color}", f"{s.ctx.group_name}.{tag}.c{color}")
        transport = _set_up(self.rank, "split", s.transport.split, color, key, ctx)
        return Communicator(transport, ctx, ranks=tuple(self.ranks[r] for r in ranks))

    # ---- after a failure: revoke, agree, shrink, grow (comm.elastic) --------------------------
    def revoke(self) -> None:
        """Fail every pending and future operation on every rank with Revoked (ULFM's revoke).
        Idempotent; any rank may call it, from any thread; shrink() is the way on."""
        elastic.revoke(self)

    def agree(self, flag: int, *, timeout: float | None = None) -> int:
        """Fault-tolerant agreement: the bitwise AND of the live ranks' flags (ints in
        [0, 2**62)), the same on every survivor even when ranks die during the call. Works on a
        failed communicator; afterwards failed_ranks() says which ranks the survivors agreed
        are gone (dead, or silent past the timeout)."""
        return elastic.agree(self, flag, timeout)

    def failed_ranks(self) -> list[int]:
        """The ranks the latest agree() or shrink() of this communicator found failed."""
        return list(self.session.failed_ranks)

    def shrink(self, timeout: float | None = None, *, exclude=()) -> "Communicator":
        """Collective over the survivors: a new communicator without the failed ranks (and
        without `exclude`, ranks removed on purpose, which do not call it), renumbered from 0 in
        the same order. Revokes this one. A rank silent for `timeout` (default: the
        communicator's) is declared failed; the store's host may be among the dead."""
        return elastic.shrink(self, timeout, exclude, connect)

    def grow(self, count: int, *, timeout: float | None = None) -> "Communicator":
        """Collective: a new communicator of these ranks and `count` new processes, each of
        which calls comm.join(join_address()); they are numbered after the old ranks."""
        return elastic.grow(self, count, timeout, connect)

    def join_address(self) -> str:
        """The address new processes pass to comm.join() to take part in this grow()."""
        return elastic.join_address(self)

    def abort(self) -> None:
        """Fail every pending and future operation at once (any thread may call it)."""
        self.session.abort()

    def close(self) -> None:
        """Release connections and shared memory. Idempotent; later calls raise Closed."""
        # the native sibling of compressed calls (comm.compress) goes first, before the transport
        self.session.close(lambda: compression.close(self))


def _set_up(rank: int, op: str, create, *args):
    """create(*args), with the operating system's failures (no descriptors, no memory) turned
    into CommErrors like every other failure of set-up."""
    try:
        return create(*args)
    except CommError:
        raise
    except OSError as e:
        raise from_os_error(e, rank=rank, op=op) from None


def transport_class(name: str, rank: int | None = None):
    """The transport registered as `name`, or TransportUnavailable saying why it cannot run here."""
    from transports import base

    cls = base.get(name)
    reason = cls.available()
    if reason is not None:
        raise TransportUnavailable(f"transport {name!r} cannot run here: {reason}", rank=rank, op="init")
    return cls


def connect(store, transport: str, group_name: str = "world", *, ranks: tuple[int, ...] | None = None,
            owned_store=None, options: dict | None = None) -> Communicator:
    """A Communicator over `transport` for the group whose bootstrap store (already scoped to the
    group, knowing its rank, size and timeout) is `store`. comm.init and the torch backend
    both end here, after their own rendezvous. `options` reach the transport (BootstrapContext):
    "cuda_device" is the GPU a CUDA transport drives."""
    cls = transport_class(transport, store.rank)
    secret = config.get("COMM_SECRET")
    if secret is None and store.size > 1:
        auth.warn_unauthenticated()
    host = rendezvous.host_id()
    host_ids = tuple(h.decode() for h in store.all_gather("topology", host.encode())) if store.size > 1 else (host,)
    ctx = BootstrapContext(store.rank, store.size, store, store.timeout, host,
                           secret.encode() if secret else None, rendezvous.bind_address(), group_name,
                           options or {}, host_ids)
    log.debug(store.rank, f"{group_name}: connecting {store.size} ranks over transport {transport}")
    world = Communicator(_set_up(store.rank, "init", cls.create, ctx), ctx, ranks=ranks, owned_store=owned_store)
    log.debug(store.rank, f"{group_name}: connected")
    return world
