"""An in-process point-to-point transport over threads, for testing comm.algorithms.

It is a real implementation of the P2P interface, not a mock: sends copy the bytes into the
receiver's mailbox (eagerly, like a small-message protocol), receives are matched to
messages per (source, tag) in posting order, sizes are checked, and waits are bounded.

    results = run_threads(n, fn)      # fn(p2p) on n threads, one per rank; results in rank order
"""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

from comm.errors import CommTimeout, Mismatch


class _Recv:
    __slots__ = ("arr", "done", "error")

    def __init__(self, arr: np.ndarray):
        self.arr = arr
        self.done = threading.Event()
        self.error: Exception | None = None


class _Sent:
    """Eager sends are complete once copied."""

    __slots__ = ()
    done = None


class Fabric:
    """The shared state of n in-process ranks: one mailbox per (dst, src, tag)."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._messages: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        self._receives: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)

    def endpoint(self, rank: int) -> InprocP2P:
        return InprocP2P(self, rank)

    def deliver(self, src: int, dst: int, tag: int, data: bytes) -> None:
        key = (dst, src, tag)
        with self._lock:
            if self._receives[key]:
                self._complete(self._receives[key].popleft(), data, src, tag)
            else:
                self._messages[key].append(data)

    def post_recv(self, dst: int, src: int, tag: int, req: _Recv) -> None:
        key = (dst, src, tag)
        with self._lock:
            if self._messages[key]:
                self._complete(req, self._messages[key].popleft(), src, tag)
            else:
                self._receives[key].append(req)

    @staticmethod
    def _complete(req: _Recv, data: bytes, src: int, tag: int) -> None:
        if len(data) != req.arr.nbytes:
            req.error = Mismatch(f"message from rank {src} tag {tag:#x} has {len(data)} bytes, "
                                 f"the receive expects {req.arr.nbytes}")
        else:
            req.arr.view(np.uint8).reshape(-1)[:] = np.frombuffer(data, np.uint8)
        req.done.set()

    def pending(self) -> int:
        """Messages sent but never received plus receives never matched (0 after a clean op)."""
        with self._lock:
            return sum(map(len, self._messages.values())) + sum(map(len, self._receives.values()))


class InprocP2P:
    """Rank `rank` of a Fabric, implementing comm.algorithms.p2p.P2P."""

    def __init__(self, fabric: Fabric, rank: int):
        self.fabric, self.rank, self.size = fabric, rank, fabric.size

    def isend(self, peer: int, tag: int, arr: np.ndarray):
        self.fabric.deliver(self.rank, peer, tag, arr.tobytes())
        return _Sent()

    def irecv(self, peer: int, tag: int, arr: np.ndarray):
        req = _Recv(arr)
        self.fabric.post_recv(self.rank, peer, tag, req)
        return req

    def wait(self, handles, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            if h.done is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.done.wait(left):
                raise CommTimeout(f"rank {self.rank}: receive not matched within {timeout:g} s")
            if h.error is not None:
                raise h.error


def run_threads(n: int, fn, *args, timeout: float = 60) -> list:
    """fn(p2p, *args) on n threads over one Fabric; each rank's result, in rank order.
    Re-raises the first rank's exception; fails if messages are left unmatched."""
    fabric = Fabric(n)
    results: list = [None] * n
    errors: list = [None] * n

    def body(r: int) -> None:
        try:
            results[r] = fn(fabric.endpoint(r), *args)
        except BaseException as e:  # noqa: BLE001  (re-raised in the test thread below)
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise TimeoutError(f"a rank thread did not finish within {timeout} s")
    for e in errors:
        if e is not None:
            raise e
    assert fabric.pending() == 0, f"{fabric.pending()} messages or receives left unmatched"
    return results
