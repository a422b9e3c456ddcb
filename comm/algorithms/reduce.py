"""Reduction kernels for every DType x ReduceOp of the contract, on numpy storage views.

Arrays are the storage views of `Buffer.numpy()` (bfloat16 is uint16). Three steps make a
reduction, so every algorithm (and MPI's user-defined operations) applies them alike:

    contribute(op, dtype, scale, dst, src)   dst = this rank's input (PREMUL_SUM: times scale)
    combine(op, dtype, acc, incoming)        acc = acc (op) incoming, in place
    finalize(op, dtype, n, arr)              AVG: divide by the group size, in place

float16 and bfloat16 are widened to float32 for each combine and rounded back once per step,
as the contract specifies; the widening happens in bounded pieces so no full-size float32
copy is ever made.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from comm.types import DType, ReduceOp

_HALF = (DType.FLOAT16, DType.BFLOAT16)
# float32 temporaries of the half-precision path are at most this many elements.
_WIDEN_ELEMS = 1 << 16

_NUMERIC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PREMUL_SUM: np.add,
            ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
            ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}
# bool: SUM/MAX are "any", PRODUCT/MIN are "all" (torch's and MPI's logical reading).
_BOOL = {ReduceOp.SUM: np.logical_or, ReduceOp.MAX: np.logical_or, ReduceOp.BOR: np.logical_or,
         ReduceOp.PRODUCT: np.logical_and, ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and,
         ReduceOp.BXOR: np.logical_xor}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact: bfloat16 is the top half of a float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> uint16 bfloat16 bits, rounded to nearest even; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16
    bits = np.where(np.isnan(x), np.uint32(0x7FC0) | ((u >> 16) & np.uint32(0x8000)), rounded)
    if out is None:
        return bits.astype(np.uint16)
    np.copyto(out, bits, casting="unsafe")
    return out


def _widen(dtype: DType, a: np.ndarray) -> np.ndarray:
    return bf16_to_f32(a) if dtype is DType.BFLOAT16 else a.astype(np.float32)


def _narrow(dtype: DType, x: np.ndarray, out: np.ndarray) -> None:
    if dtype is DType.BFLOAT16:
        f32_to_bf16(x, out)
    else:
        np.copyto(out, x, casting="unsafe")


def _pieces(n: int):
    for start in range(0, n, _WIDEN_ELEMS):
        yield slice(start, min(n, start + _WIDEN_ELEMS))


def combine(op: ReduceOp, dtype: DType, acc: np.ndarray, incoming: np.ndarray) -> None:
    """acc = acc (op) incoming, elementwise and in place (the arrays may not overlap)."""
    if dtype is DType.BOOL:
        _BOOL[op](acc, incoming, out=acc)
    elif dtype in _HALF:
        ufunc = _NUMERIC[op]
        for s in _pieces(acc.size):
            _narrow(dtype, ufunc(_widen(dtype, acc[s]), _widen(dtype, incoming[s])), acc[s])
    else:
        _NUMERIC[op](acc, incoming, out=acc)


def contribute(op: ReduceOp, dtype: DType, scale: float, dst: np.ndarray, src: np.ndarray) -> None:
    """dst = src as this rank's contribution: a copy, scaled for PREMUL_SUM. dst may be src."""
    if op is not ReduceOp.PREMUL_SUM:
        if dst is not src:
            np.copyto(dst, src)
    elif dtype in _HALF:
        for s in _pieces(src.size):
            _narrow(dtype, _widen(dtype, src[s]) * np.float32(scale), dst[s])
    else:
        np.multiply(src, dst.dtype.type(scale), out=dst)


def finalize(op: ReduceOp, dtype: DType, n: int, arr: np.ndarray) -> None:
    """The last step of a reduction on its fully reduced result: AVG divides by n."""
    if op is not ReduceOp.AVG or n == 1:
        return
    if dtype in _HALF:
        for s in _pieces(arr.size):
            _narrow(dtype, _widen(dtype, arr[s]) / np.float32(n), arr[s])
    else:
        np.divide(arr, arr.dtype.type(n), out=arr)


@dataclass(frozen=True, slots=True)
class Reduction:
    """One collective's reduction (op, dtype, PREMUL_SUM scale, group size) with the three
    steps bound, so an algorithm passes one object around."""

    op: ReduceOp
    dtype: DType
    scale: float
    size: int

    @property
    def scales_input(self) -> bool:
        """Whether a rank's contribution differs from its raw input (it cannot be sent as is)."""
        return self.op is ReduceOp.PREMUL_SUM

    def contribute(self, dst: np.ndarray, src: np.ndarray) -> None:
        contribute(self.op, self.dtype, self.scale, dst, src)

    def combine(self, acc: np.ndarray, incoming: np.ndarray) -> None:
        combine(self.op, self.dtype, acc, incoming)

    def finalize(self, arr: np.ndarray) -> None:
        finalize(self.op, self.dtype, self.size, arr)
