"""run(desc, p2p): one collective over a point-to-point transport, the algorithm chosen here.

Choices (COMM_ALGO overrides where there is one):
    all_reduce      rd (recursive doubling) up to RD_MAX_BYTES, else ring; "tree" = binomial
                    reduce to rank 0 + binomial broadcast
    reduce_scatter  ring            all_gather   ring
    broadcast       binomial tree   reduce       binomial tree
    gather/scatter  linear          all_to_all   pairwise        barrier  dissemination
Send and receive are the transport's own point-to-point operations, not collectives.
"""
from __future__ import annotations

import numpy as np

from comm import log
from comm.errors import InvalidArgument
from comm.ops import OpDesc, OpKind

from .binomial_broadcast import binomial_broadcast
from .binomial_reduce import binomial_reduce
from .dissemination_barrier import dissemination_barrier
from .linear_gather import linear_gather
from .linear_scatter import linear_scatter
from .p2p import P2P, Exchange, collective_tag
from .pairwise_all_to_all import pairwise_all_to_all
from .rd_all_reduce import rd_all_reduce
from .reduce import Reduction
from .ring_all_gather import ring_all_gather
from .ring_all_reduce import ring_all_reduce
from .ring_reduce_scatter import ring_reduce_scatter

# Below this size an all_reduce is latency bound: log2(n) whole-buffer steps beat the ring's
# 2(n-1) steps of n-th sized pieces (each step costs a Python round trip here).
RD_MAX_BYTES = 64 << 10
ALL_REDUCE_ALGOS = ("ring", "rd", "tree")


def _arrays(desc: OpDesc) -> tuple[np.ndarray | None, np.ndarray | None]:
    """numpy storage views of the op's buffers; the same object when send and recv coincide,
    which is how the algorithms recognise in-place operation."""
    send = desc.send.numpy() if desc.send is not None else None
    if desc.recv is None:
        return send, None
    if desc.send is not None and desc.send.ptr == desc.recv.ptr and desc.send.count == desc.recv.count:
        return send, send
    return send, desc.recv.numpy()


def choose_all_reduce(nbytes: int, algo: str | None) -> str:
    if algo in ALL_REDUCE_ALGOS:
        return algo
    return "rd" if nbytes <= RD_MAX_BYTES else "ring"


def _tree_all_reduce(ex: Exchange, red: Reduction, send, recv, chunk: int) -> None:
    binomial_reduce(ex, red, send, recv if ex.rank == 0 else None, 0, chunk)
    binomial_broadcast(ex, recv, 0, chunk)


_ALL_REDUCE = {"ring": ring_all_reduce, "rd": rd_all_reduce, "tree": _tree_all_reduce}


def run(desc: OpDesc, p2p: P2P, *, seq: int, timeout: float | None, chunk_bytes: int,
        algo: str | None = None) -> None:
    """Run collective `desc` (validated by the Communicator) to completion over `p2p`.

    seq numbers the group's collectives (not desc.seq, which counts point-to-point operations
    too, so it differs between ranks): it makes the tag. Every wait is bounded by `timeout`
    seconds for the whole collective. chunk_bytes bounds the temporaries (and pipelines
    trees); algo is COMM_ALGO (None: choose by size)."""
    ex = Exchange(p2p, collective_tag(seq), timeout)
    chunk = max(1, chunk_bytes // desc.dtype.itemsize)
    kind = desc.kind
    send, recv = _arrays(desc)
    if kind is OpKind.BARRIER:
        dissemination_barrier(ex)
    elif kind is OpKind.ALL_REDUCE:
        red = Reduction(desc.op, desc.dtype, desc.scale, ex.size)
        name = choose_all_reduce(recv.nbytes, algo)
        if log.enabled():
            log.algorithm(ex.rank, "", kind.label, name)
        _ALL_REDUCE[name](ex, red, send, recv, chunk)
    elif kind is OpKind.REDUCE_SCATTER:
        ring_reduce_scatter(ex, Reduction(desc.op, desc.dtype, desc.scale, ex.size), send, recv, chunk)
    elif kind is OpKind.ALL_GATHER:
        ring_all_gather(ex, send, recv)
    elif kind is OpKind.BROADCAST:
        binomial_broadcast(ex, recv, desc.root, chunk)
    elif kind is OpKind.REDUCE:
        binomial_reduce(ex, Reduction(desc.op, desc.dtype, desc.scale, ex.size), send, recv, desc.root, chunk)
    elif kind is OpKind.GATHER:
        linear_gather(ex, send, recv, desc.root)
    elif kind is OpKind.SCATTER:
        linear_scatter(ex, send, recv, desc.root)
    elif kind is OpKind.ALL_TO_ALL:
        pairwise_all_to_all(ex, send, recv, desc.send_counts, desc.recv_counts)
    else:
        raise InvalidArgument(f"{kind.label} is point-to-point, not a collective", op=kind.label)
