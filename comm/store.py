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
from .agreement import Agreements
from .gathers import Gathers, unpack_reply
from .errors import (CommError, CommTimeout, Excluded, InvalidArgument, Mismatch, PeerFailure,
                     from_os_error)

_SET, _GET, _ADD, _JOIN, _AGREE, _GATHER = 1, 2, 3, 4, 5, 6
_OK, _TIMEOUT, _MISMATCH, _REFUSED, _EXCLUDED, _GONE = 0, 1, 2, 3, 4, 5
_HDR = struct.Struct("!BIdI")        # op, key length, timeout (s), value length
_REPLY = struct.Struct("!BI")        # status, reply length
# A gather's value: member, group size, watch list length, wanted members (EVERY: all), then the
# watch list (JSON), the wanted members (uint32 each) and the member's value.
_GATHER_HDR = struct.Struct("!IIII")
_EVERY = 0xFFFFFFFF
MAX_GROUP = 1 << 20                   # members of one gather
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
    if op not in (_SET, _GET, _ADD, _JOIN, _AGREE, _GATHER) or klen > MAX_KEY or vlen > MAX_VALUE or not timeout >= 0:
        raise ConnectionError("malformed store request")
    key = auth.recv_exact(sock, klen).decode("utf-8", "strict")
    return op, key, timeout, auth.recv_exact(sock, vlen)


def _ranks(ranks, most: int = 16) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'; past `most` runs, the first ones and how many in all."""
    out, run, ranks = [], [], sorted(ranks)
    for r in ranks:
        if run and r != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(r)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    if len(out) > most:
        return ", ".join(out[:most]) + f", ... ({len(ranks)} in all)"
    return ", ".join(out)


class StoreServer:
    """Serves the store on a listening socket, one thread per client connection.

    size and agree are rank 0's world size and beliefs (e.g. {"transport": "native"}): every
    joining rank must share them. A host that takes over from a lost one (comm.elastic) has
    size 0: the ranks that come are survivors of a running job, identified by their uid;
    next_uid is the first uid it gives a newcomer (grow). first: a connection its caller
    accepted already, served before the listener's next."""

    def __init__(self, listener: socket.socket, secret: bytes | None, timeout: float, *,
                 size: int, agree: dict[str, str], where: str, next_uid: int | None = None,
                 first: tuple[socket.socket, tuple] | None = None):
        self._listener = listener
        self._secret = secret
        self._timeout = timeout
        self._size, self._agree, self._where = size, agree, where
        self._data: dict[str, bytes] = {}
        self._total = 0
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._gathers = Gathers(self._lock, lambda key, size: [self._data[f"{key}/{m}"] for m in range(size)],
                                self._gather_verdict, self._gather_timed_out, _TIMEOUT, _OK, self._count_busy)
        self._closed = False
        self._failure: str | None = None        # a disagreement: the answer to every request
        self._joined: dict[int, str] = {}        # rank -> address it came from (ever joined)
        self._live: set[int] = set()             # ranks whose connection is open
        self._told: set[int] = set()             # ranks that sent a join, accepted or not
        self._refused: list[str] = []            # recent handshake refusals, for the reports
        self._strangers = 0                      # open connections not (yet) joined
        self._busy = 0                           # requests between their frame and their reply
        self._socks: set[socket.socket] = set()    # connections not (yet) joined
        self._agreements = Agreements()
        self._next_uid = size if next_uid is None else next_uid   # for processes that join later
        self._started = time.monotonic()
        if first is not None:
            self._strangers += 1
            self._socks.add(first[0])
            threading.Thread(target=self._serve, args=(first[0], first[1][0]), daemon=True).start()
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
                    self._strangers < MAX_STRANGERS + max(0, self._size - len(self._live))
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
            self._gathers.forget(sock)
            if rank is None:
                self._strangers -= 1
            else:
                self._live.discard(rank)
                self._wake_all()   # agreements and watched waits learn it left
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
                rank, status, reply = self._join(value, addr, sock)
                self._reply(sock, status, reply)
            if rank is None:
                return
            # a rank may call split() hours later: its connection lives as long as it does
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            while True:
                op, key, timeout, value = _recv_frame(sock)
                if op == _JOIN:
                    return
                if op == _GATHER:   # answered later, by the gathers' writer, unless refused now
                    answer = self._gather(sock, key, min(timeout, self._timeout), value, rank)
                    if answer is not None:
                        self._reply(sock, *answer)
                    continue
                with self._answering():
                    status, reply = self._apply(op, key, timeout, value, rank)
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
    def _join(self, value: bytes, addr: str, sock: socket.socket) -> tuple[int | None, int, str]:
        """(rank, status, reply): rank None when refused. A join with "uid" set is a process of
        the running job (a survivor after its host was lost; reply "" when accepted); with
        "join" set, a newcomer (grow), which gets the next uid (the reply)."""
        try:
            msg = json.loads(value)
            rank, size, agree = int(msg["rank"]), int(msg["size"]), dict(msg["agree"])
            uid, newcomer = msg.get("uid"), bool(msg.get("join"))
            uid = None if uid is None else int(uid)
        except (ValueError, KeyError, TypeError, OverflowError):
            raise ConnectionError("malformed join") from None
        with self._cond:
            if uid is not None or newcomer:
                return self._join_running(uid, newcomer, addr, sock)
            if 0 <= rank < self._size:
                self._told.add(rank)
            self._cond.notify_all()
            if self._failure is not None:
                return None, _MISMATCH, self._failure
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
                self._admit(rank, addr, sock)
                return rank, _OK, ""
            if len(self._joined) < self._size:   # still setting up: nobody can succeed now
                self._fail(error)
            return None, _MISMATCH, error   # the job already runs: only the latecomer is refused

    def _join_running(self, uid: int | None, newcomer: bool, addr: str,
                      sock: socket.socket) -> tuple[int | None, int, str]:
        """With the lock held: a survivor (uid) or a newcomer joins the running job."""
        if len(self._joined) < self._size:
            return None, _MISMATCH, "the job is still starting: it cannot take a process that joins late yet"
        if newcomer:
            uid = self._next_uid
        if uid in self._agreements.excluded:
            return None, _EXCLUDED, self._excluded_text(uid)
        if uid in self._live or uid < 0:
            return None, _MISMATCH, f"two processes claim uid {uid}; the second came from {addr}"
        self._next_uid = max(self._next_uid, uid + 1)
        self._admit(uid, addr, sock)
        return uid, _OK, str(uid) if newcomer else ""

    def _admit(self, rank: int, addr: str, sock: socket.socket) -> None:
        self._joined[rank] = addr
        self._live.add(rank)
        self._strangers -= 1
        self._socks.discard(sock)   # served until the rank leaves, even after close()
        self._cond.notify_all()
        log.debug(0, f"store: rank {rank} joined from {addr}")

    @staticmethod
    def _excluded_text(uid: int) -> str:
        return (f"rank {uid} (the job's numbering) was declared failed by the survivors (it was dead "
                "or did not answer within the timeout) and is out of the job; it cannot take part in "
                "their communicators. Restart it and let it join through grow")

    def _gone(self, uid: int) -> bool:
        """With the lock held: uid left (its connection dropped) or was excluded."""
        return (uid in self._joined and uid not in self._live) or uid in self._agreements.excluded

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
        self._wake_all()

    def _wake_all(self) -> None:
        """With the lock held: every waiting request looks again at what it waits for."""
        self._cond.notify_all()
        self._gathers.wake()

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

    def _refusal(self, rank: int) -> tuple[int, bytes] | None:
        """With the lock held: the answer to any request of `rank` while the job failed or
        excluded it."""
        if self._failure is not None:
            return _MISMATCH, self._failure.encode()
        if rank in self._agreements.excluded:
            return _EXCLUDED, self._excluded_text(rank).encode()
        return None

    def _apply(self, op: int, key: str, timeout: float, value: bytes, rank: int) -> tuple[int, bytes]:
        with self._cond:
            refused = self._refusal(rank)
            if refused is not None:
                return refused
            if op == _AGREE:
                return self._agreement(key, rank, value, min(timeout, self._timeout))
            if op == _SET:
                gather, _, member = key.rpartition("/")
                answer = self._store(key, value)
                if answer[0] == _OK and member.isdigit():   # a member's value of a gather under way
                    self._gathers.arrived(gather, int(member))
                return answer
            if op == _ADD:
                n = int.from_bytes(self._data.get(key, b"\0" * 8), "little", signed=True)
                n += int.from_bytes(value[:8].ljust(8, b"\0"), "little", signed=True)
                status, reply = self._store(key, n.to_bytes(8, "little", signed=True))
                return (status, reply) if status != _OK else (_OK, self._data[key])
            timeout = min(timeout, self._timeout)   # a client cannot park a thread forever
            # a GET may name ranks whose departure ends the wait (they were to set the key)
            watch = [int(r) for r in json.loads(value)] if value else []
            left = lambda: next((r for r in watch if self._gone(r)), None)  # noqa: E731
            self._cond.wait_for(lambda: key in self._data or self._closed or self._failure is not None
                                or left() is not None, timeout)
            if self._failure is not None:
                return _MISMATCH, self._failure.encode()
            if key in self._data:
                return _OK, self._data[key]
            if left() is not None:
                return _GONE, str(left()).encode()
            return _TIMEOUT, self._why_not(None).encode()

    def _why_not(self, what: str | None) -> str:
        """With the lock held: why a wait ended unanswered: that rank 0 closed the store, `what`,
        and while the job is still gathering, who has not joined."""
        parts = ["rank 0 closed the rendezvous store" if self._closed else None, what,
                 self._waiting() if len(self._joined) < self._size else None]
        return "; ".join(p for p in parts if p)

    def _gather(self, sock: socket.socket, key: str, timeout: float, value: bytes,
                uid: int) -> tuple[int, bytes] | None:
        """One member's value for gather `key` (comm.gathers); None: the reply comes later."""
        try:
            member, size, wlen, nwant = _GATHER_HDR.unpack_from(value)
            watch = [int(r) for r in json.loads(value[_GATHER_HDR.size:_GATHER_HDR.size + wlen])] if wlen else []
            at = _GATHER_HDR.size + wlen
            want = None if nwant == _EVERY else struct.unpack_from(f"!{nwant}I", value, at)
        except (struct.error, ValueError, TypeError):
            raise ConnectionError("malformed gather") from None
        if not 0 <= member < size <= MAX_GROUP or (want is not None and any(m >= size for m in want)):
            raise ConnectionError("malformed gather")
        payload = value[at + (0 if want is None else 4 * nwant):]
        with self._cond:
            refused = self._refusal(uid)
            if refused is not None:
                return refused
            status, reply = self._store(f"{key}/{member}", payload)
            if status != _OK:
                return status, reply
            error = self._gathers.contribute(sock, key, member, size, watch, uid, time.monotonic() + timeout,
                                             lambda m: f"{key}/{m}" in self._data, want)
            return None if error is None else (_MISMATCH, error.encode())

    def _gather_verdict(self, uid: int, watch: list[int]) -> tuple[int, bytes] | None:
        """With the lock held: the answer to a gather's member whose wait ends early, if it does."""
        refused = self._refusal(uid)
        if refused is not None:
            return refused
        if self._closed:
            return _TIMEOUT, self._why_not(None).encode()
        gone = next((r for r in watch if self._gone(r)), None)
        return None if gone is None else (_GONE, str(gone).encode())

    def _gather_timed_out(self, key: str, missing: list[int], size: int) -> bytes:
        """With the lock held: why a gather's member waited in vain."""
        return self._why_not(f"members {_ranks(missing)} of {size} of the group did not get there").encode()

    def _count_busy(self, n: int) -> None:
        """With the lock held: n more (or fewer) replies owed."""
        self._busy += n
        if self._busy == 0:
            self._cond.notify_all()

    def _agreement(self, key: str, uid: int, value: bytes, timeout: float) -> tuple[int, bytes]:
        """With the lock held: uid's contribution to agreement `key`, or its acknowledgement of
        the decision (comm.agreement)."""
        agreements = self._agreements
        try:
            msg = json.loads(value)
            inst = agreements.contribute(key, uid, msg, timeout)
            members = [int(m) for m in msg["members"]]
        except (ValueError, KeyError, TypeError):
            raise ConnectionError("malformed agreement") from None
        self._cond.notify_all()
        if inst is not None:
            ready = lambda: self._closed or agreements.ready(key, inst, self._gone)  # noqa: E731
            self._cond.wait_for(ready, max(0.0, inst.deadline - time.monotonic()))
            if self._closed and key not in agreements.decided:
                return _TIMEOUT, b"the store's host closed it"
            agreements.decide(key, inst, self._gone)
            self._cond.notify_all()
        elif msg.get("ack") and not msg.get("decided"):
            if key not in agreements.decided:
                raise ConnectionError("acknowledged an agreement never decided")
            # a member that never acknowledges (hung since the decision) holds it up only so long
            self._cond.wait_for(lambda: self._closed or agreements.acknowledged(key, members, self._gone),
                                timeout)
        return _OK, json.dumps(agreements.decided[key]).encode()

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
            self._wake_all()
            # the waiters just woken owe their ranks an answer: let them send it before this
            # process (likely about to exit) takes their connections down
            self._cond.wait_for(lambda: self._busy == 0, 1.0)
            self._gathers.stop()
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
                 server: StoreServer | None = None, hello: dict | None = None):
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
            return self._call(_JOIN, "", json.dumps({"rank": self.rank, "size": self.size, "agree": agree or {},
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
        full = (self._prefix + key).encode() if kind != _JOIN else b""
        wait = self.timeout if timeout is None else timeout
        if len(full) > MAX_KEY or len(value) > MAX_VALUE:
            raise InvalidArgument(f"store key of {len(full)} bytes or value of {len(value)} bytes is over the "
                                  f"limits ({MAX_KEY}, {MAX_VALUE})", rank=self.rank, op=op)
        root = self._root
        with root._lock:
            try:
                root._sock.settimeout(wait + 5)
                root._sock.sendall(_HDR.pack(kind, len(full), wait, len(value)) + full + value)
                status, n = _REPLY.unpack(auth.recv_exact(root._sock, _REPLY.size))
                reply = auth.recv_exact(root._sock, n)
            except (OSError, ConnectionError) as e:
                raise StoreLost(f"lost the rendezvous store: {e}", rank=self.rank, op=op) from None
        if status == _TIMEOUT:
            why = reply.decode(errors="replace") or "a rank did not arrive, or did not get this far"
            raise CommTimeout(f"key {key!r} did not appear in the store within {wait:.0f} s: {why}",
                              rank=self.rank, op=op)
        if status == _MISMATCH:
            raise Mismatch(reply.decode(errors="replace"), rank=self.rank, op=op)
        if status == _REFUSED:
            raise CommError(reply.decode(errors="replace"), rank=self.rank, op=op)
        if status == _EXCLUDED:
            raise Excluded(reply.decode(errors="replace"), rank=self.rank, op=op)
        if status == _GONE:
            uid = int(reply)
            raise PeerFailure(f"the process of uid {uid} left the job while this rank waited for {key!r}",
                              rank=self.rank, op=op, peer=uid)
        return reply

    def local_address(self) -> str:
        """Our end of the store connection: an address the other ranks can reach us at."""
        return self._root._sock.getsockname()[0]

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._call(_GET, key, self._watch, timeout=timeout)

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
        reply = self._call(_GATHER, key, _GATHER_HDR.pack(self.rank, self.size, len(self._watch),
                                                          _EVERY if want is None else len(want))
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
        """Contribute to agreement `key` (comm.agreement) and return its decision."""
        return json.loads(self._call(_AGREE, key, json.dumps(msg).encode(), timeout=timeout, op="agree"))

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
        if self.membership is not None:
            self.membership.close()
