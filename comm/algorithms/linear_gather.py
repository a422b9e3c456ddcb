"""Linear gather: every rank sends its block straight to the root, which has all receives
posted at once. One step; the root receives (n-1) * count elements."""
from __future__ import annotations

import numpy as np

from .p2p import Exchange


def linear_gather(ex: Exchange, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
    if ex.rank != root:
        ex.wait(ex.send(root, send))
        return
    count = send.size
    slots = [recv[i * count:(i + 1) * count] for i in range(ex.size)]
    pending = [ex.recv(i, slots[i]) for i in range(ex.size) if i != root]
    np.copyto(slots[root], send)
    ex.wait(*pending)
