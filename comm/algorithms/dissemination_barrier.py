"""Dissemination barrier: ceil(log2 n) rounds; in round k each rank signals rank + 2**k and
waits for rank - 2**k. After the last round every rank has (transitively) heard from all."""
from __future__ import annotations

import numpy as np

from .p2p import Exchange


def dissemination_barrier(ex: Exchange) -> None:
    n, r = ex.size, ex.rank
    token, got = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
    dist = 1
    while dist < n:
        ex.sendrecv((r + dist) % n, token, (r - dist) % n, got)
        dist <<= 1
