"""Binomial-tree reduce to a root: each rank combines its children's partial results into its
own contribution and sends the sum to its parent, one chunk at a time.

Wire: each non-root rank sends count elements once. Temporaries: two chunks (none on a leaf
sending its raw input). The root's output is only written on the root.
"""
from __future__ import annotations

import numpy as np

from .p2p import Exchange
from .reduce import Reduction
from .topology import binomial_children, binomial_parent, chunks


def binomial_reduce(ex: Exchange, red: Reduction, send: np.ndarray, recv: np.ndarray | None,
                    root: int, chunk: int) -> None:
    parent = binomial_parent(ex.rank, ex.size, root)
    children = binomial_children(ex.rank, ex.size, root)
    step = min(send.size, chunk)
    # A leaf sends its input as it is, unless PREMUL_SUM must scale it first.
    scratch = np.empty(step, send.dtype) if recv is None and (children or red.scales_input) else None
    incoming = np.empty(step, send.dtype) if children else None
    for off, m in chunks(send.size, chunk):
        src = send[off:off + m]
        if recv is send:  # in place on the root
            acc = src
        else:
            acc = recv[off:off + m] if recv is not None else scratch[:m] if scratch is not None else src
        if acc is not src or red.scales_input:
            red.contribute(acc, src)
        for child in children:
            t = incoming[:m]
            ex.wait(ex.recv(child, t))
            red.combine(acc, t)
        if parent is None:
            red.finalize(acc)
        else:
            ex.wait(ex.send(parent, acc))
