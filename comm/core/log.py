"""COMM_DEBUG=1: set-up steps (rendezvous, transport, connections) and the first use of each
algorithm, on stderr, one line each, prefixed with the rank."""
from __future__ import annotations

import sys
import threading

from . import config

_seen: set[tuple] = set()
_lock = threading.Lock()


def enabled() -> bool:
    return config.get("COMM_DEBUG")


def debug(rank: int | None, message: str) -> None:
    if enabled():
        print(f"comm[rank {rank}]: {message}", file=sys.stderr, flush=True)


def algorithm(rank: int, group: str, op: str, name: str) -> None:
    """Log (once per group, op and algorithm) that `op` ran with algorithm `name`."""
    with _lock:
        if (group, op, name) in _seen:
            return
        _seen.add((group, op, name))
    debug(rank, f"{group + ': ' if group else ''}{op} uses algorithm {name}")
