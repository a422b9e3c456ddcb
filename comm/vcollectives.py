"""The v-collectives' argument checks: all_gather_v and reduce_scatter_v (MPI's Allgatherv
and Reduce_scatter) with blocks of any size. Kept apart from the Communicator, whose methods
call these, so that file stays one screenful per concern.

counts[r] is the rows (along dim 0; elements of a 1-D array) of rank r's block, the same list
on every rank; blocks are packed in rank order. The engine checks across ranks that every
rank passed the same counts (else Mismatch naming both ranks' counts); everything checkable
locally is refused here with InvalidArgument before anything is sent.
"""
from __future__ import annotations

from .core.buffers import Buffer
from .core.errors import TransportUnavailable, _integer, _many
from .core.ops import OpDesc, OpKind


def _transport_has(c, kind: OpKind) -> None:
    if kind not in c._transport.kinds:
        raise TransportUnavailable(f"transport {c.transport!r} does not support {kind.label}",
                                   rank=c.rank, op=kind.label)


def _counts(c, name: str, counts) -> tuple[int, ...]:
    try:  # integers of any kind (numpy's too); a float or bool is a bug, never a row count
        counts = tuple(map(_integer, counts))
    except TypeError:
        raise c._error(name, f"counts {counts!r} must be a sequence of integers") from None
    if len(counts) != c.size:
        raise c._error(name, f"counts have {_many(len(counts), 'entry', 'entries')}, one per rank of a group of "
                             f"{_many(c.size, 'rank', 'ranks')} expected")
    if any(k < 0 for k in counts):
        raise c._error(name, f"counts {list(counts)} have a negative entry")
    return counts


def _rows(c, name: str, buf: Buffer, rows: int, what: str, counts) -> int:
    """Elements per row of buf, which must have `rows` rows."""
    if len(buf.shape) == 0:
        raise c._error(name, f"{what} must have at least one dimension")
    if buf.shape[0] != rows:
        raise c._error(name, f"{what} has {buf.shape[0]} rows but counts {list(counts)} make it "
                             f"{rows} on rank {c.rank}")
    return buf.count // rows if rows else 0


def _pair(c, name: str, out, x, counts, gathers: bool):
    _transport_has(c, OpKind.ALL_GATHER_V if gathers else OpKind.REDUCE_SCATTER_V)
    counts = _counts(c, name, counts)
    send = c._buf(x, name, writable=False, what="input")
    recv = c._buf(out, name, writable=True, what="output")
    c._same_type(name, send, recv)
    mine, total = counts[c.rank], sum(counts)
    row_in = _rows(c, name, send, mine if gathers else total, "input", counts)
    row_out = _rows(c, name, recv, total if gathers else mine, "output", counts)
    if send.shape[1:] != recv.shape[1:] and send.count and recv.count:
        raise c._error(name, f"input rows {send.shape[1:]} and output rows {recv.shape[1:]} differ")
    row = row_in or row_out
    elems = tuple(k * row for k in counts)
    start = sum(elems[:c.rank]) * send.dtype.itemsize   # this rank's block: the in-place layout
    if gathers:
        c._apart(name, send, recv, start, f"in place, x is rank {c.rank}'s block of out")
    else:
        c._apart(name, recv, send, start, f"in place, out is rank {c.rank}'s block of x")
    return send, recv, elems


def all_gather_v(c, out, x, counts) -> OpDesc:
    send, recv, elems = _pair(c, "all_gather_v", out, x, counts, True)
    return OpDesc(OpKind.ALL_GATHER_V, send, recv, send.dtype, elems[c.rank], recv_counts=elems)


def reduce_scatter_v(c, out, x, counts, op, scale) -> OpDesc:
    name = "reduce_scatter_v"
    send, recv, elems = _pair(c, name, out, x, counts, False)
    rop, factor = c._reduce_op(name, op, send, scale)
    return OpDesc(OpKind.REDUCE_SCATTER_V, send, recv, send.dtype, elems[c.rank], rop, factor,
                  recv_counts=elems)
