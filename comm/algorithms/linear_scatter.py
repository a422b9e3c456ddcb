"""Linear scatter: the root sends each rank its block directly, all sends posted at once.
One step; the root sends (n-1) * count elements."""
from __future__ import annotations

import numpy as np

from .p2p import Exchange


def linear_scatter(ex: Exchange, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
    if ex.rank != root:
        ex.wait(ex.recv(root, recv))
        return
    count = recv.size
    pending = [ex.send(i, send[i * count:(i + 1) * count]) for i in range(ex.size) if i != root]
    np.copyto(recv, send[root * count:(root + 1) * count])
    ex.wait(*pending)
