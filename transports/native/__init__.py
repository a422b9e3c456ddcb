"""The native transport: drives the C++ engine (comm._native).

Python does the connection set-up, where speed does not matter and the standard library
has what security needs: every rank publishes its listening address through the store,
its peers are connected by transports/native/links.py (COMM_CONNECT=lazy: those the engine's
algorithms plan for, the others on first use; eager: every peer planned, so the full mesh at
set-up), every socket passes comm.bootstrap.auth's HMAC handshake, and the connected sockets are
handed to the engine. Ranks with the same host_id also share memory: each creates one
anonymous segment (memfd) and maps its local peers' segments through /proc/<pid>/fd (same
user only); nothing has a name in /dev/shm, so nothing can be left behind.

Per peer the engine gets: one monitor socket (carries no data; its hang-up means the peer
died), and for peers on other hosts (or with COMM_CHANNELS=tcp) one socket for send/recv
plus COMM_SOCKETS_PER_PEER sockets over which collective traffic is striped.

A transport over a fabric library (ucx) is this class with `net` set: the engine opens that
net (native/src/channels/README.md), every rank publishes the net's address through the store, and the
engine connects each peer over it; the monitor sockets stay, so liveness works alike.

The engine raises the comm.core.errors classes itself, from the table handed to it below at
import (set_errors): its calls need no translation here, and the lean calls (run_array,
post_array, the prepared ops' run / start / wait) go to the communicator as they come.
"""
from __future__ import annotations

import json
import os
import secrets
import time
import weakref

import numpy as np

from comm.bootstrap import rendezvous
from comm.core import config, log
from comm.core.buffers import as_buffer
from comm.core.errors import (Aborted, Closed, CommError, CommTimeout, InvalidArgument, Mismatch,
                              PeerFailure, Revoked, TransportUnavailable)
from comm.core.ops import LEAN_BUSY, LEAN_SKIPPED, held_buffers
from comm.core.types import DType
from transports.base import (BootstrapContext, DONE, OpDesc, OpKind, Request,
                             Transport, TransportWindow, register)
from transports.native.links import FIRST_COLL, MONITOR, P2P, Infos, Links, reserve_descriptors

try:
    from comm import _native
except ImportError as _e:  # the extension was not built
    _native = None
    _IMPORT_ERROR = str(_e)
else:
    # The engine's error codes as comm.core.errors classes: the one table, which the engine
    # raises from (any code not here: ERR_SYSTEM's CommError). INTERRUPTED is a Ctrl-C that
    # left no exception of its own behind.
    _ERRORS = {_native.ERR_TIMEOUT: CommTimeout, _native.ERR_PEER_FAILURE: PeerFailure,
               _native.ERR_ABORTED: Aborted, _native.ERR_MISMATCH: Mismatch,
               _native.ERR_CLOSED: Closed, _native.ERR_SYSTEM: CommError,
               _native.ERR_INVALID_ARGUMENT: InvalidArgument, _native.ERR_INTERRUPTED: Aborted,
               _native.ERR_REVOKED: Revoked}
    _native.set_errors(_ERRORS)
    Request.register(_native.Request)   # the engine's request is the protocol's
    if (_native.LEAN_SKIPPED, _native.LEAN_BUSY) != (LEAN_SKIPPED, LEAN_BUSY):
        raise ImportError("comm._native was built from other sources than this comm package; reinstall it")

# Largest per-rank payload copied through shared-memory slots; above it the single-copy
# path (process_vm_readv) or the ring takes over. Measured crossover on 2 cores.
DIRECT_MAX_BYTES = 32 << 10


def _code(e: CommError) -> int:
    """The engine's code for a comm.core.errors class (a connector's failure handed back to it)."""
    return next((code for code, cls in _ERRORS.items() if type(e) is cls), _native.ERR_SYSTEM)


class NativePrepared:
    """A persistent collective of the engine (Engine.prepare): run(busy, timeout_s) is start +
    wait in one native call, start(busy) the non-blocking start (it returns the engine's
    Prepared, whose wait / test are then the started op's); post() is the start of the
    general path."""

    __slots__ = ("run", "start", "_prepared")

    def __init__(self, prepared) -> None:
        self._prepared = prepared
        self.run, self.start = prepared.run, prepared.start

    def post(self, desc: OpDesc, blocking: bool) -> Request:
        req = self._prepared.post(blocking)
        return DONE if req is None else req


class NativeWindow(TransportWindow):
    """The engine's window (native/src/windows/window.h). Peers on this host write and read an
    allocated window (nbytes given: shared memory the engine allocates) through their own
    mapping of it, a user buffer with CMA; every other peer goes through its p2p stream,
    where the target's engine writes the bytes in. Set-up exchanges each rank's (address,
    size, id, pid, signal segment, signal count, memory segment, RMA key) through the
    engine's own all_gather (NativeTransport.exchange)."""

    def __init__(self, transport: "NativeTransport", mem, signals: int, nbytes: int | None = None) -> None:
        self._transport, self._rank = transport, transport.rank
        self._timeout = float(transport._ctx.timeout)
        engine = transport._engine
        failed = None
        try:
            if nbytes is None:
                self._w = _native.window(engine, mem.ptr, mem.nbytes, signals)
                addr, size = mem.ptr, mem.nbytes
            else:
                self._w = _native.window_allocate(engine, nbytes, signals)
                self.memory = self._w.memory()
                addr, size = self.memory.ctypes.data, nbytes
        except CommError as e:
            failed = e.locate(self._rank, "window")
        transport._windows += 1
        # The last entry: the net's RMA key (hex; empty where the net has none or was opened
        # without it, native/src/windows/rma.h). A rank that could not make its window (no memory)
        # sends why instead, so that every rank fails now rather than at the timeout.
        me = {"error": failed.cause} if failed is not None else \
            [addr, size, self._w.id, os.getpid(), self._w.signal_fd, signals, self._w.memory_fd,
             self._w.rma_key.hex()]
        infos = [json.loads(v) for v in transport.exchange(json.dumps(me).encode())]
        refused = next(((r, i["error"]) for r, i in enumerate(infos) if isinstance(i, dict)), None)
        if refused is not None:
            if type(failed) is CommError:   # the system said no (memory): the communicator is fine
                raise InvalidArgument(failed.cause, rank=self._rank, op="window")
            if failed is not None:
                raise failed
            self._w.close()
            raise InvalidArgument(f"rank {refused[0]} could not make its window ({refused[1]}); no rank made it",
                                  rank=self._rank, op="window")
        counts = {i[5] for i in infos}
        if len(counts) > 1:
            self._w.close()
            raise InvalidArgument(f"ranks asked for different signal counts ({sorted(counts)}): every rank "
                                  "must pass the same signals=", rank=self._rank, op="window")
        self.peers = [tuple(i[:5]) for i in infos]   # (address, size, id, pid, signal fd) per rank
        memory_fds = [i[6] for i in infos]
        self._call("window", self._w.connect, self.peers, memory_fds if max(memory_fds) >= 0 else [],
                   [bytes.fromhex(i[7]) for i in infos])
        # How this rank reaches each peer's window ("self", "mapped", "cma", "rma" or "message"):
        # said once under COMM_DEBUG=1, and asserted by the tests that the path they mean ran.
        self.paths = tuple(self._w.path(p) for p in range(len(infos)))
        log.debug(self._rank, f"window {transport._windows}: peers reached by "
                              f"{', '.join(f'{p}={path}' for p, path in enumerate(self.paths))}")
        # Nobody may close its signal segment (a window dropped at once) before every local
        # peer has mapped it: set-up ends together.
        transport.post(OpDesc(OpKind.BARRIER), True).wait()
        self.sizes = tuple(i[1] for i in infos)
        w = self._w   # the lean calls, bound once (comm/window.py calls them first)
        self.put_lean, self.get_lean, self.flush_lean = w.put_lean, w.get_lean, w.flush_lean
        self.wait_signal_lean = w.wait_signal_lean

    def lean_error(self, e: BaseException, op: str) -> BaseException:
        return e.locate(self._rank, op) if isinstance(e, CommError) else e

    def _call(self, op: str, fn, *args):
        try:
            return fn(*args)
        except CommError as e:   # the window's calls do not know the rank and op: named here
            raise e.locate(self._rank, op) from None

    def put(self, peer: int, src, offset: int, signal: int) -> None:
        self._call("put", self._w.put, peer, src.ptr, src.nbytes, offset, signal)

    def get(self, peer: int, dst, offset: int) -> None:
        self._call("get", self._w.get, peer, dst.ptr, dst.nbytes, offset)

    def flush(self, peer: int) -> None:
        self._call("flush", self._w.flush, peer, self._timeout)

    def wait_signal(self, k: int, value: int, timeout_s: float) -> None:
        self._call("wait_signal", self._w.wait_signal, k, value, timeout_s)

    def signal(self, k: int) -> int:
        return self._call("signal", self._w.signal, k)

    def fence(self) -> None:
        self.flush(-1)
        req = self._transport.post(OpDesc(OpKind.BARRIER), True)
        if req is not DONE:
            req.wait(self._timeout)

    def close(self) -> None:
        self._w.close()
        self.memory = None   # the engine let go of its memory: the arrays over it hold the rest


class NativeTransport(Transport):
    name = "native"
    kinds = frozenset(OpKind)
    devices = frozenset({"cpu"})
    any_source = True
    compressed_wire = True  # every compressed collective (OpDesc.wire): twolevel_compress.cc
    net: str | None = None  # the engine's net carrying the data (native/src/channels/README.md); None: shm / TCP

    @classmethod
    def net_options(cls) -> dict[str, str]:
        """Settings for the engine's net (e.g. "library": the shared library it loads)."""
        return {}

    @classmethod
    def available(cls) -> str | None:
        if _native is None:
            return f"the native engine is not built ({_IMPORT_ERROR}); run `pip install .`"
        return None

    @classmethod
    def create(cls, ctx: BootstrapContext) -> "NativeTransport":
        why = cls.available()
        if why is not None:
            raise TransportUnavailable(why, rank=ctx.rank, op="init")
        return cls(ctx)

    def __init__(self, ctx: BootstrapContext) -> None:
        self.rank, self.size = ctx.rank, ctx.size
        self._ctx = ctx
        self._links: Links | None = None  # the connections (lazy: some made on first use)
        self._windows = 0  # windows made so far (the debug log numbers them)
        self._debug = log.enabled()
        try:
            self._engine = self._bootstrap(ctx)
        except CommError as e:
            raise e.locate(ctx.rank, "init") from None
        # COMM_DEBUG logs each algorithm choice from post(): debugging takes the full path.
        self.run_array = None if self._debug else self._engine.run_array
        self.post_array = None if self._debug else self._engine.post_array
        self.recent_ops = self._engine.recent_ops

    # ---- set-up ------------------------------------------------------------------------------
    def _bootstrap(self, ctx: BootstrapContext):
        store = ctx.store
        addr = ctx.bind_addr or store.local_address()
        listener = rendezvous.listen_socket(addr)
        # A net (ucx) connects its endpoints itself, to every peer: its monitors stay a mesh.
        lazy = self.net is None and config.get("COMM_CONNECT") == "lazy"
        engine = None
        nets: dict[int, int] = {}   # a net's peers: their monitor sockets, attached after set-up
        try:
            listener.bind((addr, 0))
            listener.listen(max(128, 4 * ctx.size))
            token = secrets.token_bytes(16)
            hosts = ctx.host_ids or tuple(h.decode() for h in store.all_gather("native/hosts", ctx.host_id.encode()))
            tcp_only = self.net is not None or config.get("COMM_CHANNELS") == "tcp"
            local = [] if tcp_only else [r for r, h in enumerate(hosts) if h == ctx.host_id]
            engine = _native.Engine(ctx.rank, ctx.size, local if len(local) > 1 else [],
                                    float(ctx.timeout), config.get("COMM_ALGO") or "",
                                    int(config.get("COMM_CHUNK_BYTES")), DIRECT_MAX_BYTES)
            # The two-level algorithms' grouping: as comm.bootstrap.topology numbers hosts.
            labels = {h: i for i, h in reversed(list(enumerate(hosts)))}
            engine.set_hosts([labels[h] for h in hosts])
            peers = engine.planned_peers() if lazy else [p for p in range(ctx.size) if p != ctx.rank]
            # Only the planned peers' addresses travel: at thousands of ranks every rank's would
            # make the store's host send gigabytes. Others are fetched when first dialed (Infos).
            me = {"addr": addr, "port": listener.getsockname()[1], "token": token.hex(),
                  "sockets": max(1, int(config.get("COMM_SOCKETS_PER_PEER"))), "lazy": lazy}
            got = store.gather_some("native/info", json.dumps(me).encode(), [*peers, ctx.rank])
            infos = Infos({r: json.loads(v) for r, v in got.items()}, store, "native/info")
            eager = [r for r in sorted(got) if not infos[r]["lazy"]]
            if eager and len(eager) < len(got):
                raise InvalidArgument(f"ranks {eager[:8]} set COMM_CONNECT=eager and ranks "
                                      f"{[r for r in sorted(got) if r not in eager][:8]} lazy: every rank "
                                      "must connect alike", rank=ctx.rank, op="init")
            reserve_descriptors(ctx, infos, peers, set(local), self.net)
            # The store's gathers are collective: every rank joins them once some host
            # shares memory, even a rank alone on its host.
            if not tcp_only and len(set(labels.values())) < ctx.size:
                self._share_memory(engine, store, local if len(local) > 1 else [])
            if self.net is not None:
                addresses = store.all_gather(f"{self.name}/address", engine.open_net(self.net, self.net_options()))

            net = self.net   # not self: the links (kept by the finalizer below) must not hold the transport

            def attach(peer: int, sockets: dict) -> None:
                """Hand one peer's connected sockets to the engine (which owns them then)."""
                monitor = sockets[MONITOR].detach()
                if net is not None:   # the net connects in rank order once every monitor is in
                    nets[peer] = monitor
                    return
                coll = [sockets[k].detach() for k in sorted(sockets) if k >= FIRST_COLL]
                engine.add_peer(peer, monitor, coll, sockets[P2P].detach() if P2P in sockets else -1)

            # eager is lazy with every peer planned: one way to connect, one acceptor
            self._links = Links(ctx, listener, infos, token, set(local), engine, attach, _code, self.net)
            listener = None  # the links accept for the communicator's lifetime
            engine.set_connector(self._links.connector())
            # A communicator dropped without close(): its acceptor thread ends with it.
            weakref.finalize(self, self._links.close)
            self._links.connect_planned(peers, time.monotonic() + ctx.timeout)
            if len(peers) == ctx.size - 1:
                # every peer planned (so every peer plans this rank too: the plan is
                # symmetric): nobody will dial later, and no listener stays open
                self._links.close()
            for peer in sorted(nets):
                engine.add_net_peer(peer, nets.pop(peer), addresses[peer], hosts[peer] == ctx.host_id)
        except BaseException:
            if self._links is not None:
                self._links.close()
            if engine is not None:
                engine.set_connector(None)
            for fd in nets.values():
                os.close(fd)
            raise
        finally:
            if listener is not None:
                listener.close()
        data = (f"{self.net} with every peer" if self.net is not None else
                f"shared memory with ranks {sorted(set(local) - {ctx.rank}) or 'none'}, TCP with ranks "
                f"{sorted(set(peers) - set(local)) or 'none'}{' (more on first use)' if lazy else ''}")
        log.debug(ctx.rank, f"{ctx.group_name}: {self.name} engine listening on {addr}; {data}")
        engine.start(every_peer=not lazy)
        return engine

    @staticmethod
    def _share_memory(engine, store, local) -> None:
        # Anonymous segments (memfd), mapped by peers through /proc/<pid>/fd/<fd>: no name
        # exists that a rank killed at any point could leave behind.
        # local empty: this rank has no local peer and only takes part in the gathers.
        fd = engine.shm_create() if local else -1
        # Each rank learns its own host's segments and votes only (gather_some).
        where = store.gather_some("native/shm", json.dumps([os.getpid(), fd]).encode(), local)
        for r in local:
            engine.shm_attach(r, *json.loads(where[r]))
        cma = bool(local) and config.get("COMM_CMA") and engine.cma_probe()
        votes = store.gather_some("native/cma", b"1" if cma else b"0", local)
        if local:
            engine.set_cma(all(votes[r] == b"1" for r in local))

    # ---- operations --------------------------------------------------------------------------
    def post(self, desc: OpDesc, blocking: bool) -> Request:
        # The engine reads desc itself; the caller holds its buffers until the request ends.
        req = self._engine.post(desc, blocking)
        if req is None:
            if self._debug and desc.kind not in (OpKind.SEND, OpKind.RECV):   # the engine chose an algorithm
                log.algorithm(self.rank, self._ctx.group_name, desc.kind.label, self._engine.last_algorithm)
            return DONE
        return req

    def prepare(self, desc: OpDesc) -> NativePrepared:
        held = [(obj, buf.ptr, buf.nbytes, written, what) for obj, buf, written, what in held_buffers(desc)]
        return NativePrepared(self._engine.prepare(desc, held))

    def exchange(self, value: bytes) -> list[bytes]:
        """Collective: every rank's `value`, by rank, through the engine's own all_gather (set-up
        records, as MPI_Win_create's exchange): through the store, its host would send every
        rank's record to every rank, gigabytes at thousands of ranks."""
        n = self.size
        lengths = np.empty(n, np.int64)
        self._gather(OpKind.ALL_GATHER, np.array([len(value)], np.int64), lengths, DType.INT64, 1, ())
        out = np.empty(int(lengths.sum()), np.uint8)
        self._gather(OpKind.ALL_GATHER_V, np.frombuffer(value, np.uint8).copy(), out, DType.UINT8, len(value),
                     tuple(int(k) for k in lengths))
        ends = np.cumsum(lengths)
        return [out[e - k:e].tobytes() for e, k in zip(ends, lengths)]

    def _gather(self, kind: OpKind, send, recv, dtype: DType, count: int, counts: tuple) -> None:
        send, recv = as_buffer(send, op="window", writable=False), as_buffer(recv, op="window", writable=True)
        self.post(OpDesc(kind, send, recv, dtype, count, recv_counts=counts or None), True).wait()

    def window(self, mem, signals: int) -> NativeWindow:
        return NativeWindow(self, mem, signals)

    def window_allocate(self, nbytes: int, signals: int) -> NativeWindow:
        return NativeWindow(self, None, signals, nbytes)

    @property
    def last_algorithm(self) -> str:
        """The algorithm the engine ran for the latest collective (tests and benchmarks)."""
        return self._engine.last_algorithm

    def abort(self) -> None:
        self._engine.abort()
        self._links.close()   # a connection being made for an operation ends too

    def revoke(self) -> None:
        self._engine.revoke()
        self._links.close()

    def connected_peers(self) -> list[int]:
        """The peers this rank holds connections to (lazy: the plan and those made on first use)."""
        return self._links.connected()

    def dead_peers(self) -> list[int]:
        return self._engine.dead_peers()

    def close(self) -> None:
        self._links.close()
        self._engine.close()
        self._engine.set_connector(None)   # no operation runs now: the cycle through it ends

    def forget_after_fork(self) -> None:
        self._engine.forget_after_fork()
        self._links.forget()
        self._engine.set_connector(None)


register(NativeTransport)
