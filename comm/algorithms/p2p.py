"""The point-to-point interface the collectives are written against, and one op's view of it.

A transport that can send and receive tagged byte ranges (UCX, RDMA verbs, the in-process
test fabric) implements `P2P`; `comm.algorithms.run` then gives it every collective.

Tags: user send/recv tags are in [0, 2**31). A collective's messages carry
`collective_tag(seq)`, which has bit 31 set, so they can never match a user's receive. Within
one collective all messages between a pair of ranks share the tag and are matched in posting
order, which every algorithm here relies on (both sides post their messages to a given
peer in the same order).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from comm.errors import CommTimeout

USER_TAG_LIMIT = 1 << 31


def collective_tag(seq: int) -> int:
    """The 32-bit tag of collective number `seq` of a communicator (high bit set)."""
    return USER_TAG_LIMIT | (seq % USER_TAG_LIMIT)


class P2P(Protocol):
    """Tagged, non-blocking point-to-point messaging between the ranks of one group.

    isend/irecv take contiguous numpy arrays (any dtype; bytes are what travels) and return an
    opaque handle. A receive must be posted with the exact size of the matching send. The
    send buffer must not change, and the receive buffer is not valid, until the handle's wait
    returns. wait(handles, timeout) returns when all have completed, raising CommTimeout
    (or PeerFailure / Aborted) otherwise; timeout None means no limit.
    """

    rank: int
    size: int

    def isend(self, peer: int, tag: int, arr: np.ndarray) -> object: ...

    def irecv(self, peer: int, tag: int, arr: np.ndarray) -> object: ...

    def wait(self, handles: Sequence[object], timeout: float | None) -> None: ...


class Exchange:
    """One collective's messages: its tag, and the deadline every wait is bounded by."""

    __slots__ = ("_deadline", "_timeout", "p2p", "rank", "size", "tag")

    def __init__(self, p2p: P2P, tag: int, timeout: float | None):
        self.p2p = p2p
        self.rank, self.size = p2p.rank, p2p.size
        self.tag = tag
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout

    def send(self, peer: int, arr: np.ndarray):
        return self.p2p.isend(peer, self.tag, arr)

    def recv(self, peer: int, arr: np.ndarray):
        return self.p2p.irecv(peer, self.tag, arr)

    def wait(self, *handles) -> None:
        if self._deadline is None:
            self.p2p.wait(handles, None)
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"not completed within {self._timeout:g} s (a peer is slow, hung or "
                              "calling a different collective)")
        self.p2p.wait(handles, left)

    def sendrecv(self, dst: int, out: np.ndarray, src: int, into: np.ndarray) -> None:
        """Send `out` to dst while receiving `into` from src (posted receive first)."""
        r = self.recv(src, into)
        s = self.send(dst, out)
        self.wait(r, s)
