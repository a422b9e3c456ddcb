"""Argument checks of the full path, shared by the Communicator and the features built on it.

Plain functions of a comm.session.Session `s` (for the rank, the group size and the
transport's devices): each returns the checked value or raises InvalidArgument on this rank,
before anything is sent, leaving the communicator usable. The lean path checks its plain case
natively and hands everything else here.
"""
from __future__ import annotations

from .core.buffers import Buffer, as_buffer
from .core.errors import InvalidArgument, _integer, _many
from .core.types import DType, PremulSum, ReduceOp, op_allowed

# (op, dtype) -> allowed, precomputed: enum construction and checks cost microseconds per call,
# and the Python layer's cost is most of a small message's latency.
_REDUCE_OPS = {op: op for op in ReduceOp}
_ALLOWED = {(op, dt): op_allowed(op, dt) for op in ReduceOp for dt in DType}


def buffer(s, x, op: str, *, writable: bool, what: str) -> Buffer:
    """x as a Buffer on a device the transport reaches (CUDA data on a CPU transport starts
    the session's staging)."""
    if x is None:
        raise s.invalid(op, f"{what} buffer is required")
    try:
        buf = as_buffer(x, op=op, writable=writable)
    except InvalidArgument as e:
        raise s.invalid(op, f"{what}: {e.cause}") from None
    devices = s.transport.devices
    if buf.device not in devices:
        if buf.device == "cuda" and "cpu" in devices:
            s.staging(op)   # CUDA data through pinned host memory (comm.staging)
            return buf
        raise s.invalid(op, f"{what} is on {buf.device}, which transport {s.transport.name!r} cannot "
                            f"reach (it takes {', '.join(sorted(devices))}); "
                            "use a transport for that device (nccl for CUDA) or move the data")
    return buf


def apart(s, op: str, inner: Buffer, outer: Buffer, at: int | None, layout: str = "") -> None:
    """Refuse an input and output that share memory, except `inner` starting exactly at byte
    `at` of `outer` (the call's in-place layout, `layout` in words; None: there is none).
    Any other overlap lets a peer read what this rank is already overwriting (or the
    reverse): data silently wrong on some rank, so it is an error on this one."""
    if not inner.nbytes or not outer.nbytes or inner.device != outer.device:
        return
    if inner.ptr + inner.nbytes <= outer.ptr or outer.ptr + outer.nbytes <= inner.ptr:
        return
    if at is not None and inner.ptr == outer.ptr + at:
        return
    raise s.invalid(op, "input and output overlap" + (
        f" other than in place ({layout})" if at is not None else
        f"; {op} cannot run in place (peers read the input while the output is written): "
        "pass a separate output"))


def same_type(s, op: str, a: Buffer, b: Buffer) -> None:
    if a.dtype != b.dtype:
        raise s.invalid(op, f"mixed dtypes: input is {a.dtype.name.lower()}, output is {b.dtype.name.lower()}")
    if a.device != b.device:
        raise s.invalid(op, f"input is on {a.device}, output on {b.device}")


def same_rows(s, op: str, send: Buffer, recv: Buffer) -> None:
    """Input and output rows (every dimension after the first) must match, unless one is empty."""
    if send.shape[1:] != recv.shape[1:] and send.count and recv.count:
        raise s.invalid(op, f"input rows {send.shape[1:]} and output rows {recv.shape[1:]} differ")


def reduce_op(s, op_name: str, op, buf: Buffer, scale: float | None) -> tuple[ReduceOp, float]:
    """(the ReduceOp, its factor) of `op` (a ReduceOp or comm.premul_sum) and `scale`."""
    try:
        rop = _REDUCE_OPS.get(op) if type(op) is not PremulSum else None
    except TypeError:  # unhashable: certainly no op
        rop = None
    if rop is None:
        if type(op) is not PremulSum:
            raise s.invalid(op_name, f"unknown reduce op {op!r}")
        rop, factor = ReduceOp.PREMUL_SUM, op.factor
    else:
        factor = 1.0 if scale is None else float(scale)
        if rop is ReduceOp.PREMUL_SUM and scale is None:
            raise s.invalid(op_name, "PREMUL_SUM needs a factor: op=comm.premul_sum(f) or scale=f")
    if not _ALLOWED[rop, buf.dtype]:
        raise s.invalid(op_name, f"{rop.name} is not defined for {buf.dtype.name.lower()}")
    return rop, factor


def root(s, op: str, value, what: str = "root") -> int:
    """A rank of the group (a root, a peer, an excluded rank)."""
    try:
        rank = _integer(value)
    except TypeError:
        rank = None
    if rank is None or not 0 <= rank < s.size:
        raise s.invalid(op, f"{what} {value!r} is out of range for a group of {s.size}")
    return rank


def count_match(s, op: str, got: int, want: int, what: str) -> None:
    if got != want:
        raise s.invalid(op, f"{what} has {got} elements, expected {want}")


def counts(s, op: str, values, what: str) -> tuple[int, ...]:
    """One count per rank: the v-collectives' counts and all_to_all's splits. Integers of any
    kind (numpy's too; a float or bool is a bug, never a row count), one per rank, none
    negative."""
    try:
        values = tuple(map(_integer, values))
    except TypeError:
        raise s.invalid(op, f"{what} {values!r} must be integers, one per rank") from None
    if len(values) != s.size:
        raise s.invalid(op, f"{what} have {_many(len(values), 'entry', 'entries')}, one per rank of a group of "
                            f"{_many(s.size, 'rank', 'ranks')} expected")
    if any(k < 0 for k in values):
        raise s.invalid(op, f"{what} {list(values)} have a negative entry")
    return values


def rows(s, op: str, buf: Buffer, what: str) -> int:
    """Elements per row (along dim 0) of buf, which must have at least one dimension."""
    if len(buf.shape) == 0:
        raise s.invalid(op, f"{what} must have at least one dimension")
    have = buf.shape[0]
    return buf.count // have if have else 0


def splits(s, op: str, buf: Buffer, values, what: str) -> tuple[int, ...]:
    """all_to_all's rows of dim 0 per rank (None: equal blocks) -> element counts per rank."""
    row = rows(s, op, buf, what)
    have = buf.shape[0]
    if values is None:
        if have % s.size:
            raise s.invalid(op, f"{what} has {have} rows, not divisible by the group size {s.size}; pass splits")
        return (have // s.size * row,) * s.size
    values = counts(s, op, values, f"{what} splits")
    if sum(values) != have:
        raise s.invalid(op, f"{what} splits sum to {sum(values)} but it has {have} rows")
    return tuple(k * row for k in values)
