"""Recursive-doubling all_reduce for small messages: log2(p) exchange steps of the whole
buffer (p: the largest power of two <= n), instead of the ring's 2(n-1) latency-bound steps.

Non-power-of-two groups fold first (topology.rd_fold): the extra ranks hand their data to a
partner and get the result back at the end. Every rank combines the same two partial results
at each step (commutatively), so all ranks end with bitwise-identical results.
Wire: log2(p) * count elements per rank (+2 count on folded pairs).
"""
from __future__ import annotations

import numpy as np

from .p2p import Exchange
from .reduce import Reduction
from .topology import chunks, rd_fold, rd_partners


def rd_all_reduce(ex: Exchange, red: Reduction, send: np.ndarray, recv: np.ndarray, chunk: int) -> None:
    red.contribute(recv, send)
    vrank, fold_peer = rd_fold(ex.rank, ex.size)
    partners = [] if vrank is None else rd_partners(vrank, ex.size)
    tmp = np.empty(min(recv.size, chunk), recv.dtype)
    for off, m in chunks(recv.size, chunk):
        part, t = recv[off:off + m], tmp[:m]
        if vrank is None:  # folded away: our partner reduces for us
            ex.wait(ex.send(fold_peer, part))
            ex.wait(ex.recv(fold_peer, part))
            continue
        if fold_peer is not None:
            ex.wait(ex.recv(fold_peer, t))
            red.combine(part, t)
        for peer in partners:
            ex.sendrecv(peer, part, peer, t)
            red.combine(part, t)
        red.finalize(part)
        if fold_peer is not None:
            ex.wait(ex.send(fold_peer, part))
