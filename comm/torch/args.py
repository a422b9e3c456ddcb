"""Arguments of the torch backend's calls: torch's argument forms normalised, torch's reduce ops
as comm's, and tensors staged for comm (contiguous, complex as real pairs; outputs that are not
contiguous get a staging copy that is copied back when the operation succeeds)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..core.types import ReduceOp, premul_sum
from .work import BACKEND, Unsupported, as_torch_error

# ---- reduce ops ------------------------------------------------------------------------------
_REDUCE_OPS: dict = {}   # torch's RedOpType -> comm's op (reading a pybind enum's name is slow)


def reduce_op(op) -> ReduceOp | object:
    """torch's ReduceOp (or RedOpType) -> comm's op; PREMUL_SUM carries its factor along."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    found = _REDUCE_OPS.get(kind)
    if found is not None:
        return found
    name = kind.name
    if name == "PREMUL_SUM":
        factor = op.factor
        return premul_sum(factor.item() if isinstance(factor, torch.Tensor) else factor)
    if name not in ReduceOp.__members__:
        raise as_torch_error(Unsupported(f"backend {BACKEND} does not support ReduceOp.{name}"))
    found = _REDUCE_OPS[kind] = ReduceOp[name]
    return found


def _plain_ops() -> dict:
    """hash(torch's ReduceOp) -> comm's op, for the ops that are nothing but their type (not
    PREMUL_SUM): torch hashes a ReduceOp as its RedOpType's value, the cheapest way to read it
    (the blocking fast path's lookup). Checked against every op torch has, PREMUL_SUM included:
    where the hashes are not distinct, the table is empty and every op takes reduce_op."""
    table, hashes = {}, set()
    for name, kind in dist.ReduceOp.RedOpType.__members__.items():
        try:
            op = dist._make_nccl_premul_sum(1.0) if name == "PREMUL_SUM" else dist.ReduceOp(kind)
        except (AttributeError, RuntimeError, TypeError):
            return {}
        hashes.add(hash(op))
        if name != "PREMUL_SUM" and name in ReduceOp.__members__:
            table[hash(op)] = ReduceOp[name]
    return table if len(hashes) == len(dist.ReduceOp.RedOpType.__members__) else {}


PLAIN_OPS = _plain_ops()


def real(t: torch.Tensor) -> torch.Tensor:
    """Complex tensors travel as their real view (pairs of floats), as torch's backends do."""
    return torch.view_as_real(t) if t.is_complex() else t


def as_input(t: torch.Tensor) -> torch.Tensor:
    t = real(t)
    return t if t.is_contiguous() else t.contiguous()


def as_output(t: torch.Tensor, copies: list) -> torch.Tensor:
    """A contiguous tensor to receive into; a non-contiguous `t` gets a staging copy that is
    copied back when the operation succeeds."""
    t = real(t)
    if t.is_contiguous():
        return t
    staged = t.contiguous()
    copies.append((t, staged))
    return staged


def unpack(flat: torch.Tensor, outputs: list, copies: list) -> None:
    """Copy consecutive slices of `flat` into `outputs` on completion."""
    offset = 0
    for t in map(real, outputs):
        copies.append((t, flat[offset:offset + t.numel()].view(t.shape)))
        offset += t.numel()


def cat(tensors: list) -> torch.Tensor:
    return torch.cat([real(t).reshape(-1) for t in tensors]) if tensors else torch.empty(0)


def tensor_list(x) -> list:
    """One tensor or a sequence of them (torch's short forms pass one)."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


def options(cls, opts, first: str | None = None, timeout=None, **fields):
    """The options object of a call in any form torch's own backends accept: an options object,
    nothing (the defaults), or the short form's fields, whose first one (`first`: op, root) may
    come positionally in place of the options object, and whose timeout may come alone."""
    if isinstance(opts, cls):
        return opts
    o = cls()
    if isinstance(opts, datetime.timedelta):
        timeout = opts
    elif opts is not None:
        if first is None:
            raise TypeError(f"expected {cls.__name__} or a timeout, got {type(opts).__name__}")
        fields[first] = opts
    for name, value in fields.items():
        if value is not None:
            setattr(o, name, value)
    if timeout is not None:
        o.timeout = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    return o


def by_dtype(tensors: list) -> list[list[int]]:
    """Indices of `tensors`, grouped by dtype (each group travels flattened as one buffer)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(real(t).dtype, []).append(i)
    return list(groups.values())
