"""The bootstrap store: a small TCP key-value service hosted by rank 0.

Ranks use it only to exchange addresses and small metadata while connecting. Frames are
length-prefixed and size-checked; values are raw bytes (never pickled). With a job secret,
every connection passes comm.auth's HMAC handshake before a frame is read.

Every client's first frame says which rank it is and what it believes about the job (world
size, transport); the host compares that with rank 0's beliefs, so ranks that disagree all
learn it at once instead of waiting for a rank that will never come. While ranks are missing
the host reports which ones, and a request that times out says who never came.

The host is open to the network, so it limits what a stranger can take: keys, values and the
total stored are bounded; a connection has JOIN_DEADLINE seconds to prove the secret and say
which rank it is; connections that are no rank's are capped; and running out of file
descriptors pauses the accept loop instead of ending it.
"""
from __future__ import annotations

import contextlib
import errno
import json
import socket
import struct
import sys
import threading
import time

from . import auth, config, log, rendezvous
from .errors import CommError, CommTimeout, InvalidArgument, Mismatch, from_os_error

_SET, _GET, _ADD, _JOIN = 1, 2, 3, 4
_OK, _TIMEOUT, _MISMATCH, _REFUSED = 0, 1, 2, 3
_HDR = struct.Struct("!BIdI")        # op, key length, timeout (s), value length
_REPLY = struct.Struct("!BI")        # status, reply length
MAX_KEY = 4096
MAX_VALUE = 1 << 20                   # bootstrap data is addresses and small metadata
MAX_TOTAL = 64 << 20                  # all keys and values together
_ENTRY_COST = 64                      # bookkeeping charged per key against MAX_TOTAL
JOIN_DEADLINE = 10.0                  # seconds a new connection has to pass the handshake and join
MAX_STRANGERS = 64                    # connections not yet joined, beyond one per missing rank
LINGER = 3.0                          # seconds a host that saw a disagreement waits to tell late ranks
_FD_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _recv_frame(sock: socket.socket) -> tuple[int, str, float, bytes]:
    op, klen, timeout, vlen = _HDR.unpack(auth.recv_exact(sock, _HDR.size))
    if op not in (_SET, _GET, _ADD, _JOIN) or klen > MAX_KEY or vlen > MAX_VALUE or not timeout >= 0:
        raise ConnectionError("malformed store request")
    key = auth.recv_exact(sock, klen).decode("utf-8", "strict")
    return op, key, timeout, auth.recv_exact(sock, vlen)


def _ranks(ranks) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, run = [], []
    for r in sorted(ranks):
        if run and r != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(r)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


class StoreServer:
    """Serves the store on a listening socket, one thread per client connection.

    size and agree are rank 0's world size and beliefs (e.g. {"transport": "native"}): every
    joining rank must share them."""

    def __init__(self, listener: socket.socket, secret: bytes | None, timeout: float, *,
                 size: int, agree: dict[str, str], where: str):
        self._listener = listener
        self._secret = secret
        self._timeout = timeout
        self._size, self._agree, self._where = size, agree, where
        self._data: dict[str, bytes] = {}
        self._total = 0
        self._cond = threading.Condition()
        self._closed = False
        self._failure: str | None = None        # a disagreement: the answer to every request
        self._joined: dict[int, str] = {}        # rank -> address it came from (ever joined)
        self._live: set[int] = set()             # ranks whose connection is open
        self._told: set[int] = set()             # ranks that sent a join, accepted or not
        self._refused: list[str] = []            # recent handshake refusals, for the reports
        self._strangers = 0                      # open connections not (yet) joined
        self._busy = 0                           # requests between their frame and their reply
        self._socks: set[socket.socket] = set()    # connections not (yet) joined
        self._started = time.monotonic()
        threading.Thread(target=self._accept_loop, name="comm-store", daemon=True).start()
        interval = config.get("COMM_REPORT_INTERVAL")
        if interval > 0 and size > 1:
            threading.Thread(target=self._report_loop, args=(interval,), name="comm-store-report",
                             daemon=True).start()

    # ---- connections -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        pause = 0.0
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                # out of descriptors (or memory): connections that end will free some; until
                # then back off instead of spinning on a listener that stays readable
                pause = min(max(2 * pause, 0.01), 1.0) if e.errno in _FD_ERRORS else 0.01
                time.sleep(pause)
                continue
            pause = 0.0
            with self._cond:
                admit = not self._closed and \
                    self._strangers < MAX_STRANGERS + self._size - len(self._live)
                if admit:
                    self._strangers += 1
                    self._socks.add(sock)
            if not admit:
                sock.close()   # the client sees no greeting and tries again
                continue
            try:
                threading.Thread(target=self._serve, args=(sock, peer[0]), daemon=True).start()
            except RuntimeError:   # no thread to be had: drop this one, keep serving
                self._forget(sock, None)

    def _forget(self, sock: socket.socket, rank: int | None) -> None:
        with self._cond:
            self._socks.discard(sock)
            if rank is None:
                self._strangers -= 1
            else:
                self._live.discard(rank)
        sock.close()

    def _serve(self, sock: socket.socket, addr: str) -> None:
        rank = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + min(JOIN_DEADLINE, self._timeout)   # handshake and join
            try:
                auth.server_handshake(sock, self._secret, deadline - time.monotonic())
            except auth.SecretMismatch:
                self._secret_mismatch(addr)
                return
            except auth.HandshakeError as e:
                self._note_refused(f"{addr} ({e})")
                return
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            op, _, _, value = _recv_frame(sock)
            if op != _JOIN:
                return
            with self._answering():
                rank, error = self._join(value, addr, sock)
                self._reply(sock, _MISMATCH if rank is None else _OK, error)
            if rank is None:
                return
            # a rank may call split() hours later: its connection lives as long as it does
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            while True:
                op, key, timeout, value = _recv_frame(sock)
                if op == _JOIN:
                    return
                with self._answering():
                    status, reply = self._apply(op, key, timeout, value)
                    self._reply(sock, status, reply)
        except (OSError, ConnectionError, UnicodeDecodeError):
            return   # a client that left or misbehaved: drop it, the store lives on
        finally:
            self._forget(sock, rank)

    @contextlib.contextmanager
    def _answering(self):
        """Counts a request from its frame to its reply, so close() can let replies out."""
        with self._cond:
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    @staticmethod
    def _reply(sock: socket.socket, status: int, reply: bytes | str) -> None:
        data = reply.encode() if isinstance(reply, str) else reply
        sock.sendall(_REPLY.pack(status, len(data)) + data)

    # ---- who is here, and do they agree ------------------------------------------------------
    def _join(self, value: bytes, addr: str, sock: socket.socket) -> tuple[int | None, str]:
        try:
            msg = json.loads(value)
            rank, size, agree = int(msg["rank"]), int(msg["size"]), dict(msg["agree"])
        except (ValueError, KeyError, TypeError, OverflowError):
            raise ConnectionError("malformed join") from None
        with self._cond:
            if 0 <= rank < self._size:
                self._told.add(rank)
            self._cond.notify_all()
            if self._failure is not None:
                return None, self._failure
            error = None
            if size != self._size:
                error = (f"ranks disagree on the world size: rank 0 has {self._size}, rank {rank} (from {addr}) "
                         f"has {size}; give every rank the same WORLD_SIZE (or world_size=)")
            elif any(agree[k] != self._agree[k] for k in set(agree) & set(self._agree)):
                # a belief only one side states is no disagreement (tools join without a transport)
                what = next(k for k in sorted(set(agree) & set(self._agree)) if agree[k] != self._agree[k])
                error = (f"ranks disagree on the {what}: rank 0 has {self._agree.get(what)!r}, rank {rank} "
                         f"(from {addr}) has {agree.get(what)!r}; give every rank the same "
                         + ("COMM_TRANSPORT (or transport=)" if what == "transport" else what))
            elif not 0 <= rank < size:
                error = f"rank {rank} (from {addr}) is not in a world of size {size}"
            elif rank in self._live:
                error = (f"two processes claim rank {rank}, one from {self._joined[rank]} and one from "
                         f"{addr}; give each process its own RANK")
            if error is None:
                self._joined[rank] = addr
                self._live.add(rank)
                self._strangers -= 1
                self._socks.discard(sock)   # served until the rank leaves, even after close()
                self._cond.notify_all()
                log.debug(0, f"store: rank {rank} joined from {addr}")
                return rank, ""
            if len(self._joined) < self._size:   # still setting up: nobody can succeed now
                self._fail(error)
            return None, error   # the job already runs: only the latecomer is refused

    def _secret_mismatch(self, addr: str) -> None:
        if self._secret is not None:
            # an unauthenticated claim cannot be allowed to end the job: it may be a stranger's
            self._note_refused(f"{addr} (no COMM_SECRET)")
            return
        with self._cond:
            if len(self._joined) < self._size and self._failure is None:
                self._fail(f"a process from {addr} has COMM_SECRET set but rank 0 has not; set the "
                           "same COMM_SECRET on every rank (or on none)")

    def _fail(self, error: str) -> None:
        """With the lock held: answer every waiting and later request with `error`."""
        self._failure = error
        self._cond.notify_all()

    def _note_refused(self, what: str) -> None:
        with self._cond:
            self._refused = (self._refused + [what])[-4:]
        log.debug(0, f"store: dropped a connection from {what}")

    def _waiting(self) -> str:
        """With the lock held: which ranks are missing and where the others came from."""
        missing = [r for r in range(self._size) if r not in self._joined]
        by_addr: dict[str, list[int]] = {}
        for r, a in self._joined.items():
            by_addr.setdefault(a, []).append(r)
        came = "; ".join(f"ranks {_ranks(rs)} from {a}" for a, rs in sorted(by_addr.items())) or "nobody"
        text = (f"ranks {_ranks(missing)} of {self._size} have not joined the rendezvous at "
                f"{self._where} (joined: {came})")
        if self._refused:
            text += f"; dropped connections from {', '.join(self._refused)}"
        return text

    def _report_loop(self, interval: float) -> None:
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._closed or self._failure is not None
                                       or len(self._joined) == self._size, interval):
                    return
                text = self._waiting()
            waited = time.monotonic() - self._started
            print(f"comm: rank 0 has waited {waited:.0f} s: {text}", file=sys.stderr, flush=True)

    # ---- requests ----------------------------------------------------------------------------
    def _store(self, key: str, value: bytes) -> tuple[int, bytes]:
        """With the lock held: set key, within MAX_TOTAL."""
        old = self._data.get(key)
        grow = len(value) - (len(old) if old is not None else -len(key) - _ENTRY_COST)
        if self._total + grow > MAX_TOTAL:
            return _REFUSED, (f"the rendezvous store is full ({MAX_TOTAL >> 20} MiB); "
                              "bootstrap data should be small").encode()
        self._total += grow
        self._data[key] = value
        self._cond.notify_all()
        return _OK, b""

    def _apply(self, op: int, key: str, timeout: float, value: bytes) -> tuple[int, bytes]:
        with self._cond:
            if self._failure is not None:
                return _MISMATCH, self._failure.encode()
            if op == _SET:
                return self._store(key, value)
            if op == _ADD:
                n = int.from_bytes(self._data.get(key, b"\0" * 8), "little", signed=True)
                n += int.from_bytes(value[:8].ljust(8, b"\0"), "little", signed=True)
                status, reply = self._store(key, n.to_bytes(8, "little", signed=True))
                return (status, reply) if status != _OK else (_OK, self._data[key])
            timeout = min(timeout, self._timeout)   # a client cannot park a thread forever
            self._cond.wait_for(lambda: key in self._data or self._closed or self._failure is not None, timeout)
            if self._failure is not None:
                return _MISMATCH, self._failure.encode()
            if key in self._data:
                return _OK, self._data[key]
            why = self._waiting() if len(self._joined) < self._size else ""
            if self._closed:
                why = "rank 0 closed the rendezvous store" + (f"; {why}" if why else "")
            return _TIMEOUT, why.encode()

    def close(self) -> None:
        with self._cond:
            linger = self._failure is not None and not self._closed and len(self._told) < self._size
        if linger:
            # ranks still on their way would find no store and wait out their timeout: keep
            # answering them for a moment (the caller's error is not held up; the process's
            # exit waits for this thread)
            threading.Thread(target=self._shut, args=(min(LINGER, self._timeout),),
                             name="comm-store-linger").start()
        else:
            self._shut(0.0)

    def _shut(self, linger: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: len(self._told) >= self._size, linger)
            self._closed = True
            self._cond.notify_all()
            # the waiters just woken owe their ranks an answer: let them send it before this
            # process (likely about to exit) takes their connections down
            self._cond.wait_for(lambda: self._busy == 0, 1.0)
            socks = list(self._socks)
        # ranks' connections stay: one may still be reading its last reply
        for s in [self._listener] + socks:
            try:
                s.shutdown(socket.SHUT_RDWR)   # wakes the thread blocked on it
            except OSError:
                pass
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
    """Client of this library's store; `scoped` views share one connection.

    agree: what this rank believes about the job (e.g. {"transport": "native"}); the host
    refuses every rank if two disagree."""

    def __init__(self, addr: str, port: int, *, rank: int, size: int, timeout: float,
                 secret: bytes | None, agree: dict[str, str] | None = None,
                 server: StoreServer | None = None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._server = server
        self._prefix = ""
        self._lock = threading.Lock()
        self._sock = self._connect(addr, port, secret)
        try:
            self._call(_JOIN, "", json.dumps({"rank": rank, "size": size, "agree": agree or {}}).encode(),
                       op="init")
        except BaseException:
            self._sock.close()
            raise
        log.debug(rank, f"store: joined the rendezvous at {addr}:{port} as rank {rank} of {size}")

    @classmethod
    def host_or_connect(cls, addr: str, port: int, *, rank: int, size: int, timeout: float,
                        secret: bytes | None, agree: dict[str, str] | None = None,
                        bind_addr: str | None = None) -> "Store":
        """Rank 0 serves on `port` at bind_addr, by default the address that reaches addr
        (rendezvous.listen_address); everyone connects to addr:port."""
        server = None
        if rank == 0:
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
            server = StoreServer(listener, secret, timeout, size=size, agree=agree or {}, where=f"{addr}:{port}")
            log.debug(rank, f"store: serving the rendezvous on {bind}:{port}")
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
                if e.errno in _FD_ERRORS:   # ours, not the host's: waiting will not help
                    raise from_os_error(e, rank=self.rank, op="init") from None
                last = e
            if sock is not None:
                sock.close()
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

    def _call(self, kind: int, key: str, value: bytes = b"", timeout: float | None = None,
              op: str = "bootstrap") -> bytes:
        full = (self._prefix + key).encode() if kind != _JOIN else b""
        wait = self.timeout if timeout is None else timeout
        if len(full) > MAX_KEY or len(value) > MAX_VALUE:
            raise InvalidArgument(f"store key of {len(full)} bytes or value of {len(value)} bytes is over the "
                                  f"limits ({MAX_KEY}, {MAX_VALUE})", rank=self.rank, op=op)
        with self._lock:
            try:
                self._sock.settimeout(wait + 5)
                self._sock.sendall(_HDR.pack(kind, len(full), wait, len(value)) + full + value)
                status, n = _REPLY.unpack(auth.recv_exact(self._sock, _REPLY.size))
                reply = auth.recv_exact(self._sock, n)
            except (OSError, ConnectionError) as e:
                raise CommError(f"lost the rendezvous store: {e}", rank=self.rank, op=op) from None
        if status == _TIMEOUT:
            why = reply.decode(errors="replace") or "a rank did not arrive, or did not get this far"
            raise CommTimeout(f"key {key!r} did not appear in the store within {wait:.0f} s: {why}",
                              rank=self.rank, op=op)
        if status == _MISMATCH:
            raise Mismatch(reply.decode(errors="replace"), rank=self.rank, op=op)
        if status == _REFUSED:
            raise CommError(reply.decode(errors="replace"), rank=self.rank, op=op)
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
