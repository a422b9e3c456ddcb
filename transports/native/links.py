"""Connections between the ranks of a native communicator, and their budget of descriptors.

Every connection is a TCP socket that passes comm.bootstrap.auth's HMAC handshake, then names its rank,
its role and the acceptor's session token. A peer is a set of them: a monitor (no data; its
hang-up means the peer died), and for a peer on another host a send / recv socket plus
COMM_SOCKETS_PER_PEER collective sockets.

Links connects at set-up the peers planned for this rank, the higher rank of a pair dialing:
under COMM_CONNECT=lazy those the engine's algorithms plan for (Engine.planned_peers), and any
other peer when an operation first needs it (the listener and its acceptor then live as long
as the communicator); under eager every peer, the full mesh, after which nobody dials and the
listener closes. Both ends may need each other at once and dial together; the acceptor
answers each set's monitor connection yes or no, and of two sets dialed at once between a
pair only the lower rank's is kept.

Set-up gathers the address records (Infos) of the planned peers only; a record of any other
peer is read from the store when that peer is first dialed or dials this rank.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import select
import socket
import struct
import threading
import time
import weakref

from comm.bootstrap import auth, limits
from comm.core.errors import Closed, CommError, CommTimeout, PeerFailure

# A data connection must complete its handshake this fast (ours take milliseconds), and at
# most this many may be in progress at once: a stranger cannot hold up set-up for longer.
HANDSHAKE_S = 5.0
MAX_HANDSHAKES = 256

MONITOR, P2P, FIRST_COLL = 0, 1, 2  # socket roles, sent by the connecting side
IDENT = struct.Struct("!II16s")  # (rank, role, the acceptor's session token)
_YES, _NO = b"Y", b"N"  # a lazy set's monitor: kept, or the peer's own dial wins


def readable(socks: list, timeout: float) -> list:
    """Those of `socks` with something to read (or closed) within `timeout` seconds. poll(), not
    select(): at a thousand ranks a process's descriptors lie past select's limit of 1024 (and
    select raises on them). Raises ValueError for a socket closed under us."""
    poller = select.poll()
    by_fd = {}
    for s in socks:
        fd = s.fileno()
        if fd < 0:
            raise ValueError("a socket was closed")
        by_fd[fd] = s
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(max(0.0, timeout) * 1000)]


class Infos:
    """The peers' address records by rank: those gathered at set-up, and any other read from
    the store (the key its gather left, "<key>/<rank>") the first time it is needed."""

    def __init__(self, known: dict, store, key: str) -> None:
        self._known, self._store, self._key = known, store, key
        self._lock = threading.Lock()

    def __getitem__(self, peer: int) -> dict:
        with self._lock:
            info = self._known.get(peer)
        if info is None:   # a CommError (the store is gone) fails the connection that asked
            info = json.loads(self._store.get(f"{self._key}/{peer}"))
            with self._lock:
                self._known[peer] = info
        return info


def wake(s: socket.socket) -> None:
    """End a handshake from outside: its thread's blocked recv returns, and it closes `s`."""
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)


def roles(ctx, infos, peer: int, local: set, net: str | None) -> list[int]:
    """The sockets of one peer: a monitor, and a data set where the data is not elsewhere."""
    if net is not None or (ctx.rank in local and peer in local):
        return [MONITOR]
    # COMM_SOCKETS_PER_PEER may differ between ranks: a pair uses the fewer of its two
    n_coll = min(infos[ctx.rank]["sockets"], infos[peer]["sockets"])
    return [MONITOR, P2P] + [FIRST_COLL + i for i in range(n_coll)]


def _out_of_descriptors(ctx, op: str, e: OSError) -> CommError:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return CommError(f"out of file descriptors ({e.strerror}): `ulimit -n` allows {soft} (hard limit {hard}); "
                     "raise it", rank=ctx.rank, op=op)


def reserve_descriptors(ctx, infos, peers, local: set, net: str | None) -> None:
    """Before connecting: the descriptors the plan needs must fit under RLIMIT_NOFILE."""
    sockets = sum(len(roles(ctx, infos, p, local, net)) for p in peers)
    limits.reserve(sockets + len(local),   # local: a shared-memory segment each
                   f"{sockets} sockets to {len(peers)} peers, {len(local)} for shared memory",
                   rank=ctx.rank, op="init", hint="; COMM_CONNECT=lazy needs fewer")


def dial(ctx, info, role: int, deadline: float, op: str = "init", check=None) -> socket.socket:
    """check(): called between attempts; raises when waiting on is pointless (a peer is gone)."""
    delay = 0.01
    while True:
        try:
            s = socket.create_connection((info["addr"], info["port"]),
                                         timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise _out_of_descriptors(ctx, op, e) from None
            if time.monotonic() + delay > deadline:
                raise CommTimeout(f"cannot connect to {info['addr']}:{info['port']} ({e})",
                                  rank=ctx.rank, op=op) from None
            if check is not None:
                check()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        auth.client_handshake(s, ctx.secret, max(0.1, deadline - time.monotonic()))
        s.sendall(IDENT.pack(ctx.rank, role, bytes.fromhex(info["token"])))
    except (OSError, auth.HandshakeError) as e:
        s.close()
        raise CommError(f"connection set-up failed: {e}", rank=ctx.rank, op=op) from None
    s.settimeout(None)
    return s


class Links:
    """The lazy connections of one communicator (see the module's doc). `state[peer]`:
    "dialing" (this rank dials it), "accepting" (its set is arriving), "up" (handed to the
    engine); absent: not connected."""

    def __init__(self, ctx, listener, infos, token: bytes, local: set, engine, attach, to_code,
                 net: str | None = None) -> None:
        self._ctx, self._listener, self._infos, self._token = ctx, listener, infos, token
        self._local, self._engine, self._net = local, engine, net
        self._attach = attach    # attach(peer, {role: socket}): hands a connected set to the engine
        self._to_code = to_code  # CommError -> the engine's error code
        self._cond = threading.Condition()
        self._state: dict[int, str] = {}
        self._incoming: dict[int, dict[int, socket.socket]] = {}
        self._pending: dict[socket.socket, float] = {}  # handshakes in progress -> their deadline
        self._refused = 0
        self._closed = False
        self._handshakes: set[threading.Thread] = set()  # running: close() waits for them
        self._wake_r, self._wake_w = socket.socketpair()
        listener.setblocking(False)
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"comm-accept-{ctx.rank}")
        self._thread.start()

    # ---- this rank's side --------------------------------------------------------------------
    def connect_planned(self, peers, deadline: float) -> None:
        """Set-up: dial the planned peers below this rank, wait for those above to dial."""
        for p in sorted(peers):
            if p < self._ctx.rank:
                self.connect(p, deadline, "init")
        with self._cond:
            while True:
                missing = [p for p in peers if self._state.get(p) != "up"]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    refused = (f"; {self._refused} connection(s) failed the handshake (a rank started "
                               "with another COMM_SECRET, or a stranger)" if self._refused else "")
                    raise CommTimeout(f"connections from ranks {missing[:8]}{'...' if len(missing) > 8 else ''} "
                                      f"never arrived{refused}", rank=self._ctx.rank, op="init")
                self._cond.wait(left)

    def connect(self, peer: int, deadline: float, op: str | None = None) -> None:
        """Returns once `peer` is connected and handed to the engine."""
        with self._cond:
            while True:
                state = self._state.get(peer)
                if state == "up":
                    return
                if self._closed:
                    raise Closed("the communicator is closed", rank=self._ctx.rank, op=op)
                if state is None:
                    self._state[peer] = "dialing"
                    break
                if not self._wait(deadline):
                    raise self._late(peer, op)
        try:
            kept = self._dial_set(peer, deadline, op or "connect")
        except BaseException:
            with self._cond:
                if self._state.get(peer) == "dialing":
                    del self._state[peer]
                self._cond.notify_all()
            raise
        with self._cond:
            if kept:
                self._state[peer] = "up"
                self._cond.notify_all()
                return
            while self._state.get(peer) != "up":  # the peer's own dial won: its set arrives
                if self._closed:
                    raise Closed("the communicator is closed", rank=self._ctx.rank, op=op)
                if not self._wait(deadline):
                    raise self._late(peer, op)

    def connector(self):
        """The engine's connector (Engine.set_connector). It holds this object weakly: the engine
        must not keep its own Links alive, or neither is ever freed (a reference from C++ is
        invisible to Python's garbage collector)."""
        ref = weakref.ref(self)
        closed = self._to_code(Closed("", rank=self._ctx.rank)), "the communicator is closed"

        def connect(peer: int):
            links = ref()
            return closed if links is None else links.on_demand(peer)
        return connect

    def on_demand(self, peer: int):
        """The engine's connector: None once connected, else (error code, message)."""
        try:
            self.connect(peer, time.monotonic() + self._ctx.timeout, "connect")
            return None
        except CommError as e:
            return self._to_code(e), f"connecting to rank {peer} on first use: {e.cause}"

    def _wait(self, deadline: float) -> bool:
        """One slice of waiting for a connection (the condition held); False past the deadline."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self._cond.wait(min(left, 0.1))
        self._check()
        return True

    def _check(self) -> None:
        # A rank known dead fails the operation anyway: do not wait out the timeout for it.
        lost = self._engine.first_lost()
        if lost >= 0:
            raise PeerFailure(f"rank {lost} is gone", rank=self._ctx.rank, op="connect", peer=lost)

    def _late(self, peer: int, op) -> CommError:
        return CommTimeout(f"rank {peer} did not complete its connection within COMM_TIMEOUT "
                           f"({self._ctx.timeout:g} s): it is hung, gone, or unreachable",
                           rank=self._ctx.rank, op=op)

    def _dial_set(self, peer: int, deadline: float, op: str) -> bool:
        """Dial every socket of `peer`'s set and hand it to the engine; False when the peer
        answered no (its own dial to this rank is the one kept)."""
        info = self._infos[peer]
        want = roles(self._ctx, self._infos, peer, self._local, self._net)
        socks = {MONITOR: dial(self._ctx, info, MONITOR, deadline, op, self._check)}
        try:
            socks[MONITOR].settimeout(max(0.1, deadline - time.monotonic()))
            try:
                answer = auth.recv_exact(socks[MONITOR], 1)
            except (OSError, auth.HandshakeError) as e:
                raise PeerFailure(f"rank {peer} closed the connection during set-up ({e})",
                                  rank=self._ctx.rank, op=op, peer=peer) from None
            socks[MONITOR].settimeout(None)
            if answer != _YES:
                return False
            for role in want[1:]:
                socks[role] = dial(self._ctx, info, role, deadline, op, self._check)
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        self._attach(peer, socks)
        return True

    # ---- the acceptor ------------------------------------------------------------------------
    def _serve(self) -> None:
        """Accept connections for the communicator's lifetime. Every handshake runs on its own
        thread under its own short deadline (a stuck one is shut down), so a stranger that
        connects and stalls, trickles or sends garbage costs one thread for HANDSHAKE_S at
        most and never holds up the ranks' own connections."""
        listener = self._listener
        while True:
            now = time.monotonic()
            with self._cond:
                if self._closed:
                    return
                for s in [s for s, due in self._pending.items() if due <= now]:
                    del self._pending[s]
                    wake(s)
                wait = min(self._pending.values(), default=now + 3600) - now
            try:
                ready = readable([listener, self._wake_r], wait)
            except (OSError, ValueError):  # closed under us
                return
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            if listener not in ready:
                continue
            try:
                s, _ = listener.accept()
            except (BlockingIOError, ConnectionAbortedError):
                continue
            except OSError:  # out of file descriptors or memory: retry a little later
                time.sleep(0.05)
                continue
            with self._cond:
                if self._closed or len(self._pending) >= MAX_HANDSHAKES:  # a flood: drop rather than grow
                    s.close()
                    continue
                self._pending[s] = time.monotonic() + HANDSHAKE_S
                t = threading.Thread(target=self._handshake, args=(s,), daemon=True,
                                     name=f"comm-handshake-{self._ctx.rank}")
                self._handshakes.add(t)
            t.start()

    def _handshake(self, s: socket.socket) -> None:
        try:
            self._admit(s)
        finally:
            with self._cond:
                self._handshakes.discard(threading.current_thread())

    def _admit(self, s: socket.socket) -> None:
        ctx = self._ctx
        try:
            auth.server_handshake(s, ctx.secret, HANDSHAKE_S)
            s.settimeout(HANDSHAKE_S)
            peer, role, their_token = IDENT.unpack(auth.recv_exact(s, IDENT.size))
            ours = their_token == self._token and 0 <= peer < ctx.size and peer != ctx.rank
            ours = ours and role in roles(ctx, self._infos, peer, self._local, self._net)
        except (OSError, auth.HandshakeError, CommError) as e:  # a stranger, a wrong secret, no store
            ours = False
            if isinstance(e, auth.HandshakeError):
                with self._cond:
                    self._refused += 1
        complete = None
        with self._cond:
            if self._pending.pop(s, None) is None or not ours or self._closed:
                s.close()   # evicted by its deadline, not ours, or the communicator is closed
                return
            state = self._state.get(peer)
            if role == MONITOR:
                # Kept unless this rank dials the peer too and is the lower of the two.
                keep = state is None or (state == "dialing" and peer < ctx.rank)
                try:
                    s.sendall(_YES if keep else _NO)
                except OSError:
                    keep = False
                if not keep:
                    s.close()
                    return
                self._state[peer] = "accepting"
                self._incoming[peer] = {MONITOR: s}
            elif state == "accepting" and role not in self._incoming[peer]:
                self._incoming[peer][role] = s
            else:
                s.close()
                return
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            want = roles(ctx, self._infos, peer, self._local, self._net)
            if len(self._incoming[peer]) == len(want):
                complete = self._incoming.pop(peer)
        if complete is None:
            return
        try:
            self._attach(peer, complete)
        except Exception:   # the communicator closed meanwhile: the engine closed what it got
            with self._cond:
                self._state.pop(peer, None)
                self._cond.notify_all()
            return
        with self._cond:
            self._state[peer] = "up"
            self._cond.notify_all()

    # ---- the end -----------------------------------------------------------------------------
    def connected(self) -> list[int]:
        with self._cond:
            return sorted(p for p, s in self._state.items() if s == "up")

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            for s in self._pending:
                wake(s)
            for socks in self._incoming.values():
                for s in socks.values():
                    s.close()
            self._incoming.clear()
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._cond:   # each was woken above, or ends within its handshake deadline
            running = list(self._handshakes)
        for t in running:
            t.join(timeout=HANDSHAKE_S)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def forget(self) -> None:
        """In a forked child: close this process's copies; the threads are the parent's."""
        self._closed = True
        for s in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(s.detach())
