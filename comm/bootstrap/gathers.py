"""The store host's gathers: one request and one reply per member, whatever the group's size.

A member's request leaves its value and returns; its serving thread goes back to reading the
connection (the client sends nothing until it has the reply). The last member's value
completes the gather, and one writer thread sends every member the reply with non-blocking
sends, so a member that does not read holds up nobody, and no thread per member is woken: at
thousands of members, waking a Python thread each (a condition variable's notify_all) costs
seconds in GIL hand-offs alone. The writer also answers the members whose wait ended otherwise:
their deadline passed, the job failed, the host closed, or a rank they watch left.
"""
from __future__ import annotations

import collections
import itertools
import select
import socket
import struct
import threading
import time
from typing import Callable

from .store_wire import REPLY

LEN = struct.Struct("!I")    # the reply: the count, the members' lengths, then their values


class _Gather:
    __slots__ = ("size", "missing", "waiting", "wants")

    def __init__(self, size: int, missing: set[int]) -> None:
        self.size, self.missing = size, missing
        # members owed a reply: their connection -> (deadline, uids watched, their uid)
        self.waiting: dict[socket.socket, tuple[float, list[int], int]] = {}
        # members that asked for some members' values only: their connection -> those members
        self.wants: dict[socket.socket, tuple[int, ...]] = {}


def pack_reply(values: list[bytes]) -> bytes:
    return struct.pack(f"!I{len(values)}I", len(values), *map(len, values)) + b"".join(values)


def unpack_reply(reply: bytes) -> list[bytes]:
    (n,) = LEN.unpack_from(reply)
    lengths = struct.unpack_from(f"!{n}I", reply, LEN.size)
    ends = list(itertools.accumulate(lengths, initial=LEN.size * (n + 1)))
    return [reply[a:b] for a, b in zip(ends, ends[1:])]


class Gathers:
    """The gathers of one store host. Every method but the writer's own runs with `lock` held.

    A member's value is the host's key "<gather key>/<member>" (set by the host before
    contribute()), so a gather is the old set-then-get-every-key in one round trip, and any
    client may still read a member's value with a get. values(key, size) reads them back.
    verdict(uid, watch) answers for a waiting member when its wait must end early (the job
    failed, the host closed, the member was excluded, or a watched uid left): (status, reply)
    or None. timed_out(key, missing, size) is the reply text of a member whose deadline passed."""

    def __init__(self, lock, values: Callable[[str, int], list[bytes]],
                 verdict: Callable[[int, list[int]], tuple[int, bytes] | None],
                 timed_out: Callable[[str, list[int], int], bytes], timeout_status: int,
                 ok_status: int, busy: Callable[[int], None]) -> None:
        self._lock = lock
        self._values, self._verdict, self._timed_out = values, verdict, timed_out
        self._timeout_status, self._ok = timeout_status, ok_status
        self._busy = busy   # counts what is queued and not yet sent (the host's close waits for it)
        self._open: dict[str, _Gather] = {}
        # replies not yet sent; the writer sends with the lock held (MSG_DONTWAIT: never long),
        # so a connection forget() dropped is never written to after
        self._outbox: dict[socket.socket, collections.deque] = {}
        self._next_sweep = float("inf")
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopped = False
        threading.Thread(target=self._writer, name="comm-store-replies", daemon=True).start()

    def contribute(self, sock, key: str, member: int, size: int, watch: list[int], uid: int,
                   deadline: float, present: Callable[[int], bool],
                   want: tuple[int, ...] | None = None) -> str | None:
        """Member `member` of a group of `size` waits for gather `key` (its value is set);
        present(m): member m's value is set; want: the members whose values it asks for (None:
        all). None: the reply will come from the writer; else the disagreement to answer now."""
        g = self._open.get(key)
        if g is None:   # values set before the gather opened (a plain set of a member's key) count
            g = self._open[key] = _Gather(size, {m for m in range(size) if not present(m)})
        if g.size != size:
            return f"ranks disagree on the size of the group gathering {key!r}: {g.size} and {size}"
        g.waiting[sock] = (deadline, watch, uid)
        if want is not None:
            g.wants[sock] = want
        self.arrived(key, member)
        if key not in self._open:
            return None   # this value was the last: every member has its answer queued
        # a watched uid that left before this member got here wakes nobody again: ask now
        answer = self._verdict(uid, watch)
        if answer is not None:
            self._answer_early(g, sock, answer)
            self._poke()
            return None
        if deadline < self._next_sweep:
            self._next_sweep = deadline
            self._poke()
        return None

    def arrived(self, key: str, member: int) -> None:
        """Member `member`'s value for gather `key` is set (by contribute, or a plain set)."""
        g = self._open.get(key)
        if g is None:
            return
        g.missing.discard(member)
        if not g.missing:
            values = self._values(key, g.size)
            everything = pack_reply(values) if len(g.wants) < len(g.waiting) else b""
            for s in g.waiting:
                want = g.wants.get(s)
                self._queue(s, self._ok, everything if want is None else pack_reply([values[m] for m in want]))
            del self._open[key]
            self._poke()

    def wake(self) -> None:
        """Something a waiting member's verdict depends on changed: look at every one now (what
        they are owed is queued before this returns: the host's close waits for it)."""
        self._sweep(time.monotonic(), everyone=True)
        self._poke()

    def forget(self, sock) -> None:
        """sock's client left: nothing more is sent to it (the caller closes it after this)."""
        dropped = self._outbox.pop(sock, None)
        if dropped:
            self._busy(-len(dropped))
        for g in self._open.values():
            g.waiting.pop(sock, None)
            g.wants.pop(sock, None)

    def stop(self) -> None:
        self._stopped = True
        self._poke()

    # ---- the writer --------------------------------------------------------------------------
    def _queue(self, sock, status: int, reply: bytes) -> None:
        self._busy(2)   # the host's busy count counts what is queued: two pieces a reply
        # the header and the reply apart: every member's queue shares the one reply object
        self._outbox.setdefault(sock, collections.deque()).extend(
            (memoryview(REPLY.pack(status, len(reply))), memoryview(reply)))

    def _poke(self) -> None:
        try:
            self._wake_w.send(b"!", socket.MSG_DONTWAIT)
        except OSError:   # a wake-up is pending already (the pipe is full)
            pass

    def _sweep(self, now: float, everyone: bool = False) -> None:
        """With the lock held: answer the members whose wait is over for a reason other than
        the last value (everyone: ask the verdict of each, else only of those past their
        deadline); remember the next deadline."""
        self._next_sweep = float("inf")
        for key, g in list(self._open.items()):
            for s, (deadline, watch, uid) in list(g.waiting.items()):
                answer = self._verdict(uid, watch) if everyone or deadline <= now else None
                if answer is None and deadline <= now:
                    answer = self._timeout_status, self._timed_out(key, sorted(g.missing), g.size)
                if answer is None:
                    self._next_sweep = min(self._next_sweep, deadline)
                    continue
                self._answer_early(g, s, answer)
            if not g.waiting:   # nobody waits for it any more: the host forgets it
                del self._open[key]

    def _answer_early(self, g: _Gather, sock, answer: tuple[int, bytes]) -> None:
        """With the lock held: sock waits for gather `g` no more; `answer` is what it gets."""
        del g.waiting[sock]
        g.wants.pop(sock, None)
        self._queue(sock, *answer)

    def _writer(self) -> None:
        while True:
            with self._lock:
                if self._stopped and not self._outbox:
                    break
                now = time.monotonic()
                if self._next_sweep <= now:
                    self._sweep(now)
                pending = [s for s, q in self._outbox.items() if q]
                wait = min(max(0.0, self._next_sweep - now), 1.0)
            # poll(), not select(): thousands of members' descriptors lie past select's 1024
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            by_fd = {}
            for s in pending:
                fd = s.fileno()
                if fd >= 0:   # -1: closed since (forget() dropped it)
                    by_fd[fd] = s
                    poller.register(fd, select.POLLOUT)
            events = poller.poll(wait * 1000)
            if any(fd == self._wake_r.fileno() for fd, _ in events):
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
            writable = [by_fd[fd] for fd, _ in events if fd in by_fd]
            if writable:
                with self._lock:
                    for s in writable:
                        self._send(s)
        self._wake_r.close()
        self._wake_w.close()

    def _send(self, sock) -> None:
        """With the lock held: as much of sock's queued replies as it takes now."""
        q = self._outbox.get(sock)
        done = 0
        while q:
            try:
                n = sock.send(q[0], socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:   # the client left: its reader thread forgets it
                done += len(q)
                q.clear()
                break
            q[0] = q[0][n:]
            if not q[0]:
                q.popleft()
                done += 1
        if q is not None and not q:
            del self._outbox[sock]
        if done:
            self._busy(-done)
