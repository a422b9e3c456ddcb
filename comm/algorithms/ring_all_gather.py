"""Ring all_gather: n-1 steps; at each, every rank passes the segment it got last to its right.

Wire: each rank sends (n-1) * count elements. No temporary memory: segments are received in
place in the output. `ring_pass` is also the second half of the ring all_reduce.
"""
from __future__ import annotations

import numpy as np

from .p2p import Exchange
from .topology import ring_neighbours


def ring_pass(ex: Exchange, segs: list[np.ndarray], have: int) -> None:
    """Each rank starts with segs[have] complete (its left neighbour with segs[have - 1]);
    after size-1 steps every rank has every segment."""
    n = ex.size
    left, right = ring_neighbours(ex.rank, n)
    for s in range(n - 1):
        ex.sendrecv(right, segs[(have - s) % n], left, segs[(have - s - 1) % n])


def ring_all_gather(ex: Exchange, send: np.ndarray, recv: np.ndarray) -> None:
    count = send.size
    segs = [recv[i * count:(i + 1) * count] for i in range(ex.size)]
    mine = segs[ex.rank]
    if mine.ctypes.data != send.ctypes.data:  # in place when the input is already our slot
        np.copyto(mine, send)
    ring_pass(ex, segs, ex.rank)
