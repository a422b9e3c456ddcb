"""The bootstrap store: a small TCP key-value service hosted by rank 0.

Ranks use it only to exchange addresses and small metadata while connecting. Frames are
length-prefixed and size-checked; values are raw bytes (never pickled). With a job secret,
every connection passes comm.auth's HMAC handshake before a frame is read.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

from . import auth
from .errors import CommError, CommTimeout, InvalidArgument

_SET, _GET, _ADD = 1, 2, 3
_OK, _TIMEOUT = 0, 1
_HDR = struct.Struct("!BIdI")        # op, key length, timeout (s), value length
MAX_KEY = 4096
MAX_VALUE = 64 << 20                  # bootstrap data is small; refuse anything absurd


def _recv_frame(sock: socket.socket) -> tuple[int, str, float, bytes]:
    op, klen, timeout, vlen = _HDR.unpack(auth.recv_exact(sock, _HDR.size))
    if op not in (_SET, _GET, _ADD) or klen > MAX_KEY or vlen > MAX_VALUE or not timeout >= 0:
        raise ConnectionError("malformed store request")
    key = auth.recv_exact(sock, klen).decode("utf-8", "strict")
    return op, key, timeout, auth.recv_exact(sock, vlen)


class StoreServer:
    """Serves the store on a listening socket, one thread per client connection."""

    def __init__(self, listener: socket.socket, secret: bytes | None, timeout: float):
        self._listener = listener
        self._secret = secret
        self._timeout = timeout
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._accept_loop, name="comm-store", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                auth.server_handshake(sock, self._secret, self._timeout)
                while True:
                    op, key, timeout, value = _recv_frame(sock)
                    status, reply = self._apply(op, key, timeout, value)
                    sock.sendall(struct.pack("!BI", status, len(reply)) + reply)
            except (OSError, ConnectionError, UnicodeDecodeError):
                return   # a client that left or misbehaved: drop it, the store lives on

    def _apply(self, op: int, key: str, timeout: float, value: bytes) -> tuple[int, bytes]:
        with self._cond:
            if op == _SET:
                self._data[key] = value
                self._cond.notify_all()
                return _OK, b""
            if op == _ADD:
                n = int.from_bytes(self._data.get(key, b"\0" * 8), "little", signed=True)
                n += int.from_bytes(value[:8].ljust(8, b"\0"), "little", signed=True)
                self._data[key] = n.to_bytes(8, "little", signed=True)
                self._cond.notify_all()
                return _OK, self._data[key]
            timeout = min(timeout, self._timeout)   # a client cannot park a thread forever
            if not self._cond.wait_for(lambda: key in self._data or self._closed, timeout):
                return _TIMEOUT, b""
            return (_OK, self._data[key]) if key in self._data else (_TIMEOUT, b"")

    def close(self) -> None:
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        try:
            self._listener.close()
        except OSError:
            pass


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

    def barrier(self, key: str) -> None:
        if self.add(f"{key}/count", 1) == self.size:
            self.set(f"{key}/done", b"")
        self.get(f"{key}/done")


class Store(KeyValueStore):
    """Client of this library's store; `scoped` views share one connection."""

    def __init__(self, addr: str, port: int, *, rank: int, size: int, timeout: float,
                 secret: bytes | None, server: StoreServer | None = None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._server = server
        self._prefix = ""
        self._lock = threading.Lock()
        self._sock = self._connect(addr, port, secret)

    @classmethod
    def host_or_connect(cls, addr: str, port: int, *, rank: int, size: int, timeout: float,
                        secret: bytes | None, bind_addr: str | None = None) -> "Store":
        """Rank 0 serves on `port` (all interfaces unless bind_addr); everyone connects to addr:port."""
        server = None
        if rank == 0:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((bind_addr or "", port))
            except OSError as e:
                listener.close()
                raise InvalidArgument(f"cannot listen on {addr}:{port} for the rendezvous ({e.strerror}); "
                                      "is the port in use? pick another MASTER_PORT", rank=rank, op="init") from None
            listener.listen(max(128, size))
            server = StoreServer(listener, secret, timeout)
        return cls(addr, port, rank=rank, size=size, timeout=timeout, secret=secret, server=server)

    def _connect(self, addr: str, port: int, secret: bytes | None) -> socket.socket:
        deadline = time.monotonic() + self.timeout
        delay, last = 0.01, None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic()))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                auth.client_handshake(sock, secret, self.timeout)
                sock.settimeout(None)
                return sock
            except auth.HandshakeError as e:
                raise CommError(f"rendezvous at {addr}:{port} refused us: {e}", rank=self.rank, op="init") from None
            except OSError as e:
                last = e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        raise CommTimeout(f"no rendezvous at {addr}:{port} within {self.timeout:.0f} s ({last}); "
                          "is rank 0 running and MASTER_ADDR/MASTER_PORT right?", rank=self.rank, op="init")

    def scoped(self, prefix: str, rank: int | None = None, size: int | None = None) -> "Store":
        """A view whose keys live under `prefix/` (for one group: its rank and size)."""
        view = object.__new__(Store)
        view.__dict__.update(self.__dict__)
        view._prefix = f"{self._prefix}{prefix}/"
        view.rank = self.rank if rank is None else rank
        view.size = self.size if size is None else size
        return view

    def _call(self, op: int, key: str, value: bytes = b"", timeout: float | None = None) -> bytes:
        full = (self._prefix + key).encode()
        wait = self.timeout if timeout is None else timeout
        with self._lock:
            try:
                self._sock.settimeout(wait + 5)
                self._sock.sendall(_HDR.pack(op, len(full), wait, len(value)) + full + value)
                status, n = struct.unpack("!BI", auth.recv_exact(self._sock, 5))
                reply = auth.recv_exact(self._sock, n)
            except (OSError, ConnectionError) as e:
                raise CommError(f"lost the rendezvous store: {e}", rank=self.rank, op="bootstrap") from None
        if status == _TIMEOUT:
            raise CommTimeout(f"key {key!r} did not appear in the store within {wait:.0f} s "
                              "(a rank did not arrive)", rank=self.rank, op="bootstrap")
        return reply

    def local_address(self) -> str:
        """Our end of the store connection: an address the other ranks can reach us at."""
        return self._sock.getsockname()[0]

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._call(_GET, key, timeout=timeout)

    def add(self, key: str, amount: int) -> int:
        return int.from_bytes(self._call(_ADD, key, amount.to_bytes(8, "little", signed=True)),
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
