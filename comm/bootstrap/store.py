"""The bootstrap store's clients: ranks use it only to exchange addresses and small metadata
while connecting, through a small TCP key-value service hosted by rank 0 (comm.bootstrap.store_host).
With a job secret, every connection passes comm.bootstrap.auth's HMAC handshake before a frame is read.
KeyValueStore holds what transports need of any store (torch's too: comm.torch.store).
"""
from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time

from . import auth, limits, rendezvous
from ..core import log
from .gathers import unpack_reply
from ..core.errors import CommError, CommTimeout, Excluded, InvalidArgument, Mismatch, PeerFailure, from_os_error
from .store_host import StoreServer
from .store_process import OWN_PROCESS_FROM, HostProcess
from .store_wire import (ADD, AGREE, EVERY, EXCLUDED, FD_ERRORS, GATHER, GATHER_HDR, GET, GONE, HDR, JOIN, MAX_KEY, MAX_VALUE,
                         MISMATCH, REFUSED, REPLY, SET, TIMEOUT)

class KeyValueStore:
    """What transports need of a bootstrap store. Subclasses provide set / get / add /
    local_address / scoped / close and the rank, size and timeout of their group; the
    collective helpers below are written once on top of them."""

    rank: int
    size: int
    timeout: float

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        """Every rank's value for `key`, indexed by rank."""
        self.set(f"{key}/{self.rank}", value)
        return [value if r == self.rank else self.get(f"{key}/{r}") for r in range(self.size)]

    def gather_some(self, key: str, value: bytes, want) -> dict[int, bytes]:
        """Collective like all_gather (every rank gives its value), but this rank gets the
        values of the ranks in `want` only, by rank. Any rank's value stays readable later
        with get(f"{key}/{rank}")."""
        self.set(f"{key}/{self.rank}", value)
        return {r: value if r == self.rank else self.get(f"{key}/{r}") for r in sorted(set(want))}

    def barrier(self, key: str) -> None:
        if self.add(f"{key}/count", 1) == self.size:
            self.set(f"{key}/done", b"")
        self.get(f"{key}/done")


class StoreLost(CommError):
    """The connection to the store's host broke (its process died): comm.elastic moves on to
    a new host."""


class Store(KeyValueStore):
    """Client of this library's store; `scoped` views share one connection (their `_root`'s,
    which comm.elastic may move to a new host).

    agree: what this rank believes about the job (e.g. {"transport": "native"}); the host
    refuses every rank if two disagree. hello: more for the host to know of this process
    ({"uid": n} for a survivor of a running job, {"join": True} for a newcomer: its uid is
    then the host's reply, in `joined`)."""

    def __init__(self, addr: str, port: int, *, rank: int, size: int, timeout: float,
                 secret: bytes | None, agree: dict[str, str] | None = None,
                 server: StoreServer | HostProcess | None = None, hello: dict | None = None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._server = server
        self._prefix = ""
        self._watch = b""
        self._root = self
        self._secret = secret
        self.membership = None   # comm.elastic.Membership: this process in an elastic job
        self._lock = threading.Lock()
        self.joined = self._join(self._connect(addr, port, secret), agree, hello)
        log.debug(rank, f"store: joined the rendezvous at {addr}:{port} as rank {rank} of {size}")

    def _join(self, sock: socket.socket, agree: dict | None, hello: dict | None) -> bytes:
        self._sock = sock
        try:
            return self._call(JOIN, "", json.dumps({"rank": self.rank, "size": self.size, "agree": agree or {},
                                                      **(hello or {})}).encode(), op="init")
        except BaseException:
            self._sock.close()
            raise

    def reconnect(self, sock: socket.socket, hello: dict) -> None:
        """Move this connection (and every view's) to `sock`, connected and past the handshake
        with a new host (comm.elastic)."""
        old = self._sock
        try:
            self._join(sock, None, hello)
        except BaseException:
            self._sock = old
            raise
        with contextlib.suppress(OSError):
            old.close()

    def host_address(self) -> tuple[str, int]:
        """Where the host serving this connection listens."""
        return self._root._sock.getpeername()[:2]

    @classmethod
    def host_or_connect(cls, addr: str, port: int, *, rank: int, size: int, timeout: float,
                        secret: bytes | None, agree: dict[str, str] | None = None,
                        bind_addr: str | None = None) -> "Store":
        """Rank 0 serves on `port` at bind_addr, by default the address that reaches addr
        (rendezvous.listen_address); everyone connects to addr:port."""
        server = None
        if rank == 0:
            # The host keeps a connection from every rank for the job's life (split, shrink
            # and windows use the store after init): in this process, or in a child that
            # inherits the limit raised here.
            limits.reserve(size, f"a connection from each of the {size} ranks to the rendezvous store "
                           "this rank hosts", rank=rank, op="init")
            try:
                bind = bind_addr or rendezvous.listen_address(addr)
            except InvalidArgument as e:
                raise e.locate(rank, "init") from None
            try:
                listener = rendezvous.listen_socket(bind)
            except OSError as e:
                raise from_os_error(e, rank=rank, op="init") from None
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((bind, port))
                listener.listen(max(128, size))
            except OSError as e:
                listener.close()
                raise InvalidArgument(f"cannot listen on {bind}:{port} for the rendezvous at {addr} ({e.strerror}); "
                                      "is the port in use? pick another MASTER_PORT (COMM_BIND_ADDR "
                                      "chooses the address)", rank=rank, op="init") from None
            args = dict(size=size, agree=agree or {}, where=f"{addr}:{port}")
            try:
                server = HostProcess(listener, secret, timeout, **args) if size >= OWN_PROCESS_FROM else None
            except OSError as e:   # no interpreter to start (embedded Python): host it here
                log.debug(rank, f"store: no process of its own for the host ({e}); serving it in this one")
            if server is None:
                server = StoreServer(listener, secret, timeout, **args)
            log.debug(rank, f"store: serving the rendezvous on {bind}:{port}"
                            f"{' in a process of its own' if isinstance(server, HostProcess) else ''}")
        try:
            return cls(addr, port, rank=rank, size=size, timeout=timeout, secret=secret, agree=agree,
                       server=server)
        except BaseException:
            if server is not None:
                server.close()
            raise

    def _connect(self, addr: str, port: int, secret: bytes | None) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        delay, last = 0.01, None
        while time.monotonic() < deadline:
            sock = None
            try:
                sock = socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic()))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                auth.client_handshake(sock, secret, max(0.1, deadline - time.monotonic()))
                sock.settimeout(None)
                return sock
            except auth.Unanswered as e:   # the host is at its connection cap: try again
                last = e
            except auth.HandshakeError as e:
                sock.close()
                raise CommError(f"rendezvous at {addr}:{port} refused us: {e}", rank=self.rank, op="init") from None
            except OSError as e:
                if e.errno in FD_ERRORS:   # ours, not the host's: waiting will not help
                    raise from_os_error(e, rank=self.rank, op="init") from None
                last = e
            if sock is not None:
                sock.close()
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        raise CommTimeout(f"no rendezvous at {addr}:{port} within {self.timeout:.0f} s ({last}); "
                          "is rank 0 running and MASTER_ADDR/MASTER_PORT right?", rank=self.rank, op="init")

    def scoped(self, prefix: str, rank: int | None = None, size: int | None = None,
               watch: list[int] | None = None) -> "Store":
        """A view whose keys live under `prefix/` (for one group: its rank and size). watch:
        uids whose departure from the job ends any wait of this view (with PeerFailure)."""
        view = object.__new__(Store)
        view.__dict__.update(self.__dict__)
        view._prefix = f"{self._prefix}{prefix}/"
        view.rank = self.rank if rank is None else rank
        view.size = self.size if size is None else size
        if watch is not None:
            view._watch = json.dumps(sorted(watch)).encode()
        return view

    def _call(self, kind: int, key: str, value: bytes = b"", timeout: float | None = None,
              op: str = "bootstrap") -> bytes:
        full = (self._prefix + key).encode() if kind != JOIN else b""
        wait = self.timeout if timeout is None else timeout
        if len(full) > MAX_KEY or len(value) > MAX_VALUE:
            raise InvalidArgument(f"store key of {len(full)} bytes or value of {len(value)} bytes is over the "
                                  f"limits ({MAX_KEY}, {MAX_VALUE})", rank=self.rank, op=op)
        root = self._root
        with root._lock:
            try:
                root._sock.settimeout(wait + 5)
                root._sock.sendall(HDR.pack(kind, len(full), wait, len(value)) + full + value)
                status, n = REPLY.unpack(auth.recv_exact(root._sock, REPLY.size))
                reply = auth.recv_exact(root._sock, n)
            except (OSError, ConnectionError) as e:
                raise StoreLost(f"lost the rendezvous store: {e}", rank=self.rank, op=op) from None
        if status == TIMEOUT:
            why = reply.decode(errors="replace") or "a rank did not arrive, or did not get this far"
            raise CommTimeout(f"key {key!r} did not appear in the store within {wait:.0f} s: {why}",
                              rank=self.rank, op=op)
        if status == MISMATCH:
            raise Mismatch(reply.decode(errors="replace"), rank=self.rank, op=op)
        if status == REFUSED:
            raise CommError(reply.decode(errors="replace"), rank=self.rank, op=op)
        if status == EXCLUDED:
            raise Excluded(reply.decode(errors="replace"), rank=self.rank, op=op)
        if status == GONE:
            uid = int(reply)
            raise PeerFailure(f"the process of uid {uid} left the job while this rank waited for {key!r}",
                              rank=self.rank, op=op, peer=uid)
        return reply

    def local_address(self) -> str:
        """Our end of the store connection: an address the other ranks can reach us at."""
        return self._root._sock.getsockname()[0]

    def set(self, key: str, value: bytes) -> None:
        self._call(SET, key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._call(GET, key, self._watch, timeout=timeout)

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        """One request and one reply, whatever the group's size (the host answers when every
        member's value is there)."""
        return self._gather(key, value, None)

    def gather_some(self, key: str, value: bytes, want) -> dict[int, bytes]:
        """all_gather's one round trip, answered with the values of the members in `want` only:
        at thousands of ranks, replies of every member's value would make the host send
        gigabytes where each rank needs a few dozen."""
        want = sorted(set(want))
        if want and not 0 <= want[0] <= want[-1] < self.size:
            bad = next(r for r in want if not 0 <= r < self.size)
            raise InvalidArgument(f"gather {key!r} asks for rank {bad}, not in the group of {self.size}",
                                  rank=self.rank, op="bootstrap")
        return dict(zip(want, self._gather(key, value, want)))

    def _gather(self, key: str, value: bytes, want: list[int] | None) -> list[bytes]:
        wanted = b"" if want is None else struct.pack(f"!{len(want)}I", *want)
        reply = self._call(GATHER, key, GATHER_HDR.pack(self.rank, self.size, len(self._watch),
                                                          EVERY if want is None else len(want))
                           + self._watch + wanted + value)
        try:
            values = unpack_reply(reply)
        except struct.error:
            values = []
        expect = self.size if want is None else len(want)
        if len(values) != expect:
            raise CommError(f"the store's host answered gather {key!r} with {len(values)} values where "
                            f"{expect} were asked for", rank=self.rank, op="bootstrap")
        return values

    def barrier(self, key: str) -> None:
        self.all_gather(key, b"")

    def agree(self, key: str, msg: dict, timeout: float) -> dict:
        """Contribute to agreement `key` (comm.bootstrap.agreement) and return its decision."""
        return json.loads(self._call(AGREE, key, json.dumps(msg).encode(), timeout=timeout, op="agree"))

    def add(self, key: str, amount: int) -> int:
        return int.from_bytes(self._call(ADD, key, amount.to_bytes(8, "little", signed=True)),
                              "little", signed=True)

    def close(self) -> None:
        if self._prefix:
            return  # views do not own the connection
        try:
            self._sock.close()
        except OSError:
            pass
        if self._server is not None:
            self._server.close()
        if self.membership is not None:
            self.membership.close()
