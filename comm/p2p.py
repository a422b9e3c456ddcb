"""Batched point-to-point: post many isend / irecv at once (torch's batch_isend_irecv).

    ops = [P2POp("irecv", left_buf, left), P2POp("isend", right_buf, right)]
    for work in group.batch_p2p(ops):
        work.wait()

Every transport here progresses isend / irecv independently of posting order, so any
order of a batch completes (the native engine matches per (peer, tag) and parks messages no
receive is waiting for yet). Sends are still posted first: their bytes start moving while
the receives are being posted. Messages with the same (peer, tag) keep their relative
order, as the transports match them in posting order.
"""
from __future__ import annotations

from dataclasses import dataclass

from .core.buffers import as_buffer
from .core.errors import InvalidArgument

_KINDS = ("isend", "irecv")


@dataclass(frozen=True)
class P2POp:
    """One point-to-point operation of a batch.

    op      "isend" or "irecv", or the Communicator methods (Communicator.isend, world.irecv)
    tensor  the array to send, or to receive into (numpy, torch, DLPack; contiguous)
    peer    the other rank, in the group the batch is posted on
    tag     integer in [0, 2**31); same (peer, tag) messages match in order
    """

    op: object
    tensor: object
    peer: int
    tag: int = 0

    @property
    def kind(self) -> str:
        """ "isend" or "irecv" (ValueError for anything else)."""
        name = self.op if isinstance(self.op, str) else getattr(self.op, "__name__", None)
        if name not in _KINDS:
            raise ValueError(f"P2POp.op must be 'isend', 'irecv' or those Communicator methods, got {self.op!r}")
        return name


def batch_p2p(group, ops) -> list:
    """Post every op of `ops` on `group`; returns their Works in the order of `ops`.

    All ops are checked before any is posted, so a bad one leaves nothing in flight.
    """
    ops = list(ops)
    kinds = [_check(group, i, p) for i, p in enumerate(ops)]
    works: list = [None] * len(ops)
    for want in ("isend", "irecv"):
        for i, (p, kind) in enumerate(zip(ops, kinds)):
            if kind == want:
                post = group.irecv if kind == "irecv" else group.isend
                works[i] = post(p.tensor, p.peer, p.tag)
    return works


def _check(group, i: int, p) -> str:
    def bad(cause: str) -> InvalidArgument:
        return InvalidArgument(f"op {i}: {cause}", rank=group.rank, op="batch_p2p")

    if not isinstance(p, P2POp):
        raise bad(f"expected a P2POp, got {type(p).__name__}")
    try:
        kind = p.kind
    except ValueError as e:
        raise bad(str(e)) from None
    bound_to = getattr(p.op, "__self__", group)
    if bound_to is not group:
        raise bad(f"{kind} is bound to {bound_to!r}, not to the group the batch is posted on")
    if isinstance(p.peer, bool) or not isinstance(p.peer, int) or not 0 <= p.peer < group.size or p.peer == group.rank:
        raise bad(f"peer {p.peer!r} must be another rank of the group of {group.size}")
    if isinstance(p.tag, bool) or not isinstance(p.tag, int) or not 0 <= p.tag < 2**31:
        raise bad(f"tag {p.tag!r} must be an integer in [0, 2**31)")
    try:
        as_buffer(p.tensor, op="batch_p2p", writable=kind == "irecv")
    except InvalidArgument as e:
        raise bad(e.cause) from None
    return kind
