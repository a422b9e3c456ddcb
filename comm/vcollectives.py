"""The v-collectives' argument checks: all_gather_v and reduce_scatter_v (MPI's Allgatherv
and Reduce_scatter) with blocks of any size. Kept apart from the Communicator, whose methods
call these, so that file stays one screenful per concern.

counts[r] is the rows (along dim 0; elements of a 1-D array) of rank r's block, the same list
on every rank; blocks are packed in rank order. The engine checks across ranks that every
rank passed the same counts (else Mismatch naming both ranks' counts); everything checkable
locally is refused here with InvalidArgument before anything is sent.
"""
from __future__ import annotations

from . import checks
from .core.buffers import Buffer
from .core.errors import TransportUnavailable
from .core.ops import OpDesc, OpKind


def _rows(s, name: str, buf: Buffer, rows: int, what: str, counts) -> int:
    """Elements per row of buf, which must have `rows` rows."""
    row = checks.rows(s, name, buf, what)
    if buf.shape[0] != rows:
        raise s.invalid(name, f"{what} has {buf.shape[0]} rows but counts {list(counts)} make it "
                              f"{rows} on rank {s.rank}")
    return row


def _pair(s, name: str, out, x, counts, gathers: bool):
    kind = OpKind.ALL_GATHER_V if gathers else OpKind.REDUCE_SCATTER_V
    if kind not in s.transport.kinds:
        raise TransportUnavailable(f"transport {s.transport.name!r} does not support {kind.label}",
                                   rank=s.rank, op=kind.label)
    counts = checks.counts(s, name, counts, "counts")
    send = checks.buffer(s, x, name, writable=False, what="input")
    recv = checks.buffer(s, out, name, writable=True, what="output")
    checks.same_type(s, name, send, recv)
    mine, total = counts[s.rank], sum(counts)
    row_in = _rows(s, name, send, mine if gathers else total, "input", counts)
    row_out = _rows(s, name, recv, total if gathers else mine, "output", counts)
    checks.same_rows(s, name, send, recv)
    row = row_in or row_out
    elems = tuple(k * row for k in counts)
    start = sum(elems[:s.rank]) * send.dtype.itemsize   # this rank's block: the in-place layout
    if gathers:
        checks.apart(s, name, send, recv, start, f"in place, x is rank {s.rank}'s block of out")
    else:
        checks.apart(s, name, recv, send, start, f"in place, out is rank {s.rank}'s block of x")
    return send, recv, elems


def all_gather_v(s, out, x, counts) -> OpDesc:
    """The OpDesc of an all_gather_v on session `s` (comm.session.Session)."""
    send, recv, elems = _pair(s, "all_gather_v", out, x, counts, True)
    return OpDesc(OpKind.ALL_GATHER_V, send, recv, send.dtype, elems[s.rank], recv_counts=elems)


def reduce_scatter_v(s, out, x, counts, op, scale) -> OpDesc:
    """The OpDesc of a reduce_scatter_v on session `s`."""
    name = "reduce_scatter_v"
    send, recv, elems = _pair(s, name, out, x, counts, False)
    rop, factor = checks.reduce_op(s, name, op, send, scale)
    return OpDesc(OpKind.REDUCE_SCATTER_V, send, recv, send.dtype, elems[s.rank], rop, factor,
                  recv_counts=elems)
