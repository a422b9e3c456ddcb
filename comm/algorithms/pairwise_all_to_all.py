"""Pairwise all_to_all(v): n-1 steps; at step s rank r sends its block for r+s and receives
the block of r-s, so each step is a perfect matching and no rank is flooded.

Wire: each rank sends sum(send_counts) - send_counts[rank] elements. Blocks of any size,
zero included (both sides know every count, so the empty messages cannot mismatch).
"""
from __future__ import annotations

import itertools

import numpy as np

from .p2p import Exchange


def _blocks(arr: np.ndarray, counts) -> list[np.ndarray]:
    bounds = [0, *itertools.accumulate(counts)]
    return [arr[a:b] for a, b in itertools.pairwise(bounds)]


def pairwise_all_to_all(ex: Exchange, send: np.ndarray, recv: np.ndarray,
                        send_counts, recv_counts) -> None:
    n, r = ex.size, ex.rank
    out, into = _blocks(send, send_counts), _blocks(recv, recv_counts)
    np.copyto(into[r], out[r])
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        ex.sendrecv(dst, out[dst], src, into[src])
