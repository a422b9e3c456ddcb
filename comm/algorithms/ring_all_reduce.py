"""Ring all_reduce: a ring reduce_scatter of n segments in the output, then a ring all_gather.

Wire: each rank sends 2 (n-1)/n * count elements, the bandwidth optimum. The output holds the
partial sums; inputs above n * chunk elements are done in rounds of that size, so the only
temporary is one segment of one round.
"""
from __future__ import annotations

import numpy as np

from .p2p import Exchange
from .reduce import Reduction
from .ring_all_gather import ring_pass
from .ring_reduce_scatter import ring_reduce_blocks
from .topology import chunks, segment_bounds


def ring_all_reduce(ex: Exchange, red: Reduction, send: np.ndarray, recv: np.ndarray, chunk: int) -> None:
    n, count = ex.size, recv.size
    red.contribute(recv, send)
    round_size = n * chunk
    incoming = np.empty(-(-min(count, round_size) // n), recv.dtype)
    owned = (ex.rank + 1) % n  # the segment this rank completes (ring_reduce_blocks' `final`)
    for off, m in chunks(count, round_size):
        piece = recv[off:off + m]
        segs = [piece[slice(*segment_bounds(m, n, i))] for i in range(n)]
        ring_reduce_blocks(ex, red, segs, segs, incoming, owned)
        red.finalize(segs[owned])
        ring_pass(ex, segs, owned)
