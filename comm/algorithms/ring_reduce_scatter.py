"""Ring reduce_scatter: n-1 steps; a partial sum of each block travels once around the ring,
each rank adding its contribution, and ends complete at the block's owner.

Wire: each rank sends (n-1) * count elements. Large inputs are processed in slices of
`chunk` elements per block, so the temporaries stay at two slices whatever the size.
`ring_reduce_blocks` is also the first half of the ring all_reduce.
"""
from __future__ import annotations

import numpy as np

from .p2p import Exchange
from .reduce import Reduction
from .topology import chunks, ring_neighbours


def ring_reduce_blocks(ex: Exchange, red: Reduction, ins: list[np.ndarray], outs: list[np.ndarray],
                       incoming: np.ndarray, final: int) -> None:
    """Reduce block b of every rank into this rank's outs[final] (final = its block).

    ins[b]: this rank's input for block b (read only). outs[b]: where block b's partial sum is
    formed and sent from; outs may be ins itself when the contributions are already in place
    (all_reduce), else the partials of foreign blocks may all share one scratch array (each
    is sent before the next is formed). `incoming` holds at least the largest block."""
    n = ex.size
    left, right = ring_neighbours(ex.rank, n)
    in_place = outs is ins
    b = (final - 1) % n  # our first message: our own contribution to the block left of ours
    if not in_place:
        red.contribute(outs[b], ins[b])
    for s in range(n - 1):
        nxt = (final - 2 - s) % n
        tmp = incoming[:outs[nxt].size]
        ex.sendrecv(right, outs[b], left, tmp)
        if not in_place:
            red.contribute(outs[nxt], ins[nxt])
        red.combine(outs[nxt], tmp)
        b = nxt


def ring_reduce_scatter(ex: Exchange, red: Reduction, send: np.ndarray, recv: np.ndarray,
                        chunk: int) -> None:
    n, count = ex.size, recv.size
    step = min(count, chunk)
    scratch = np.empty(step, recv.dtype)
    incoming = np.empty(step, recv.dtype)
    for off, m in chunks(count, chunk):
        ins = [send[b * count + off:b * count + off + m] for b in range(n)]
        outs = [scratch[:m]] * n
        outs[ex.rank] = recv[off:off + m]
        ring_reduce_blocks(ex, red, ins, outs, incoming, ex.rank)
        red.finalize(outs[ex.rank])
