"""The bootstrap store's host: a small TCP key-value service that rank 0 runs (comm.bootstrap.store has
the clients and the protocol's description).

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
import json
import socket
import struct
import sys
import threading
import time

from . import auth
from ..core import config, log
from .agreement import Agreements
from .gathers import Gathers
from .store_wire import (ADD, AGREE, EVERY, EXCLUDED, FD_ERRORS, GATHER, GATHER_HDR, GONE, JOIN, MAX_GROUP, MISMATCH,
                         OK, REFUSED, REPLY, SET, TIMEOUT, recv_frame)

MAX_TOTAL = 64 << 20                  # all keys and values together
_ENTRY_COST = 64                      # bookkeeping charged per key against MAX_TOTAL
JOIN_DEADLINE = 10.0                  # seconds a new connection has to pass the handshake and join
MAX_STRANGERS = 64                    # connections not yet joined, beyond one per missing rank
LINGER = 3.0                          # seconds a host that saw a disagreement waits to tell late ranks


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
                                self._gather_verdict, self._gather_timed_out, TIMEOUT, OK, self._count_busy)
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
                pause = min(max(2 * pause, 0.01), 1.0) if e.errno in FD_ERRORS else 0.01
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
            op, _, _, value = recv_frame(sock)
            if op != JOIN:
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
                op, key, timeout, value = recv_frame(sock)
                if op == JOIN:
                    return
                if op == GATHER:   # answered later, by the gathers' writer, unless refused now
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
        sock.sendall(REPLY.pack(status, len(data)) + data)

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
                return None, MISMATCH, self._failure
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
                return rank, OK, ""
            if len(self._joined) < self._size:   # still setting up: nobody can succeed now
                self._fail(error)
            return None, MISMATCH, error   # the job already runs: only the latecomer is refused

    def _join_running(self, uid: int | None, newcomer: bool, addr: str,
                      sock: socket.socket) -> tuple[int | None, int, str]:
        """With the lock held: a survivor (uid) or a newcomer joins the running job."""
        if len(self._joined) < self._size:
            return None, MISMATCH, "the job is still starting: it cannot take a process that joins late yet"
        if newcomer:
            uid = self._next_uid
        if uid in self._agreements.excluded:
            return None, EXCLUDED, self._excluded_text(uid)
        if uid in self._live or uid < 0:
            return None, MISMATCH, f"two processes claim uid {uid}; the second came from {addr}"
        self._next_uid = max(self._next_uid, uid + 1)
        self._admit(uid, addr, sock)
        return uid, OK, str(uid) if newcomer else ""

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
            return REFUSED, (f"the rendezvous store is full ({MAX_TOTAL >> 20} MiB); "
                              "bootstrap data should be small").encode()
        self._total += grow
        self._data[key] = value
        self._cond.notify_all()
        return OK, b""

    def _refusal(self, rank: int) -> tuple[int, bytes] | None:
        """With the lock held: the answer to any request of `rank` while the job failed or
        excluded it."""
        if self._failure is not None:
            return MISMATCH, self._failure.encode()
        if rank in self._agreements.excluded:
            return EXCLUDED, self._excluded_text(rank).encode()
        return None

    def _apply(self, op: int, key: str, timeout: float, value: bytes, rank: int) -> tuple[int, bytes]:
        with self._cond:
            refused = self._refusal(rank)
            if refused is not None:
                return refused
            if op == AGREE:
                return self._agreement(key, rank, value, min(timeout, self._timeout))
            if op == SET:
                gather, _, member = key.rpartition("/")
                answer = self._store(key, value)
                if answer[0] == OK and member.isdigit():   # a member's value of a gather under way
                    self._gathers.arrived(gather, int(member))
                return answer
            if op == ADD:
                n = int.from_bytes(self._data.get(key, b"\0" * 8), "little", signed=True)
                n += int.from_bytes(value[:8].ljust(8, b"\0"), "little", signed=True)
                status, reply = self._store(key, n.to_bytes(8, "little", signed=True))
                return (status, reply) if status != OK else (OK, self._data[key])
            timeout = min(timeout, self._timeout)   # a client cannot park a thread forever
            # a GET may name ranks whose departure ends the wait (they were to set the key)
            watch = [int(r) for r in json.loads(value)] if value else []
            left = lambda: next((r for r in watch if self._gone(r)), None)  # noqa: E731
            self._cond.wait_for(lambda: key in self._data or self._closed or self._failure is not None
                                or left() is not None, timeout)
            if self._failure is not None:
                return MISMATCH, self._failure.encode()
            if key in self._data:
                return OK, self._data[key]
            if left() is not None:
                return GONE, str(left()).encode()
            return TIMEOUT, self._why_not(None).encode()

    def _why_not(self, what: str | None) -> str:
        """With the lock held: why a wait ended unanswered: that rank 0 closed the store, `what`,
        and while the job is still gathering, who has not joined."""
        parts = ["rank 0 closed the rendezvous store" if self._closed else None, what,
                 self._waiting() if len(self._joined) < self._size else None]
        return "; ".join(p for p in parts if p)

    def _gather(self, sock: socket.socket, key: str, timeout: float, value: bytes,
                uid: int) -> tuple[int, bytes] | None:
        """One member's value for gather `key` (comm.bootstrap.gathers); None: the reply comes later."""
        try:
            member, size, wlen, nwant = GATHER_HDR.unpack_from(value)
            watch = [int(r) for r in json.loads(value[GATHER_HDR.size:GATHER_HDR.size + wlen])] if wlen else []
            at = GATHER_HDR.size + wlen
            want = None if nwant == EVERY else struct.unpack_from(f"!{nwant}I", value, at)
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
            if status != OK:
                return status, reply
            error = self._gathers.contribute(sock, key, member, size, watch, uid, time.monotonic() + timeout,
                                             lambda m: f"{key}/{m}" in self._data, want)
            return None if error is None else (MISMATCH, error.encode())

    def _gather_verdict(self, uid: int, watch: list[int]) -> tuple[int, bytes] | None:
        """With the lock held: the answer to a gather's member whose wait ends early, if it does."""
        refused = self._refusal(uid)
        if refused is not None:
            return refused
        if self._closed:
            return TIMEOUT, self._why_not(None).encode()
        gone = next((r for r in watch if self._gone(r)), None)
        return None if gone is None else (GONE, str(gone).encode())

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
        the decision (comm.bootstrap.agreement)."""
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
                return TIMEOUT, b"the store's host closed it"
            agreements.decide(key, inst, self._gone)
            self._cond.notify_all()
        elif msg.get("ack") and not msg.get("decided"):
            if key not in agreements.decided:
                raise ConnectionError("acknowledged an agreement never decided")
            # a member that never acknowledges (hung since the decision) holds it up only so long
            self._cond.wait_for(lambda: self._closed or agreements.acknowledged(key, members, self._gone),
                                timeout)
        return OK, json.dumps(agreements.decided[key]).encode()

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
