"""Binomial-tree broadcast: ceil(log2 n) levels; each rank receives a chunk from its parent
and forwards it to its children (largest subtree first) while the next chunk arrives.

Wire: the root sends count elements per child; every other rank receives count once.
"""
from __future__ import annotations

import numpy as np

from .p2p import Exchange
from .topology import binomial_children, binomial_parent, chunks


def binomial_broadcast(ex: Exchange, buf: np.ndarray, root: int, chunk: int) -> None:
    parent = binomial_parent(ex.rank, ex.size, root)
    children = binomial_children(ex.rank, ex.size, root)[::-1]
    pending = []
    for off, m in chunks(buf.size, chunk):
        piece = buf[off:off + m]
        if parent is not None:
            ex.wait(ex.recv(parent, piece))
        pending += [ex.send(child, piece) for child in children]
    ex.wait(*pending)
