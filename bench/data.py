"""Exactly predictable inputs and the results every collective must produce from them.

Every element is a small integer, so sums, averages, minima, maxima and products are exact in
every dtype (float16 and bfloat16 included) and the check compares bit for bit: #wrong counts
elements that differ, with no tolerance. Element i of rank r's input is `pattern[i] + r`, where
`pattern` is a hash of i in [0, 7] (no short period, so a shifted or misplaced block shows up).
Exactness bounds: the sum of n ranks is at most 7n + n(n-1)/2, exact in bfloat16 up to n = 16
and in float16 up to n = 58; int8/uint8 sums wrap, and the expected values wrap the same way.
"""
from __future__ import annotations

import functools

import numpy as np

from comm.core.types import DType, ReduceOp

PREMUL_FACTOR = 0.5   # the factor of "mulsum" (PREMUL_SUM); a power of two keeps it exact
SENTINEL = 99         # what an output buffer holds before the operation writes it

_pattern = np.zeros(0, np.int64)


def pattern(count: int) -> np.ndarray:
    """The first `count` values of the hash pattern, int64 in [0, 7] (computed once, sliced)."""
    global _pattern
    if count > len(_pattern):
        i = np.arange(max(count, 2 * len(_pattern)), dtype=np.uint64)
        _pattern = (((i * np.uint64(0x9E3779B1)) >> np.uint64(13)) & np.uint64(7)).astype(np.int64)
    return _pattern[:count]


def storage(values: np.ndarray, dtype: DType) -> np.ndarray:
    """Small integers (or halves) -> the storage array of `dtype` (bfloat16 as uint16 bits)."""
    if dtype is DType.BFLOAT16:   # exact for these values: truncating the float32 bits is exact
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if dtype is DType.BOOL:
        return (values.astype(np.int64) & 1).astype(np.bool_)
    if not dtype.is_floating:     # integers wrap modulo 2**bits, as the engines do
        return values.astype(np.int64).astype(dtype.numpy_storage)
    return values.astype(dtype.numpy_storage)


def _kept(make):
    """make(...) kept for the last two argument lists, read-only (a caller must copy it to
    write): every transport and repetition at one size uses the same inputs and expected
    results, and building 64 MiB of them took a third of a sweep's time."""
    @functools.lru_cache(maxsize=2)
    def kept(*args):
        out = make(*args)
        out.setflags(write=False)
        return out
    return functools.wraps(make)(kept)


@_kept
def stored_input(count: int, dtype: DType, op: ReduceOp, rank: int, size: int) -> np.ndarray:
    """storage(reduce_input(...)): rank `rank`'s input of a reduction as the storage of `dtype`."""
    return storage(reduce_input(count, dtype, op, rank, size), dtype)


@_kept
def sentinel(count: int, dtype: DType) -> np.ndarray:
    """What an output buffer holds before the operation writes it (SENTINEL everywhere)."""
    return storage(np.full(count, SENTINEL), dtype)


def _signed(dtype: DType) -> bool:
    return dtype.is_floating or dtype in (DType.INT8, DType.INT16, DType.INT32, DType.INT64)


def reduce_input(count: int, dtype: DType, op: ReduceOp, rank: int, size: int) -> np.ndarray:
    """Rank `rank`'s input of a reduction (int64/float64 values before storage())."""
    b = pattern(count)
    if op is ReduceOp.PRODUCT and dtype is not DType.BOOL:
        # +-1 everywhere except a 2 on one rank per element: the product stays +-2
        i = np.arange(count)
        v = np.where(i % size == rank, 2, 1)
        return v * np.where((b + rank) & 1, -1, 1) if _signed(dtype) else v
    return b + rank


@_kept
def reduce_expected(count: int, dtype: DType, op: ReduceOp, size: int) -> np.ndarray:
    """The reduction of every rank's reduce_input(), as the storage array of `dtype` (read-only)."""
    b = pattern(count)
    n = size
    if dtype is DType.BOOL:   # bool: sum/max are "or", product/min are "and"
        bits = np.stack([(b + r) & 1 for r in range(n)]).astype(bool)
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return bits.any(0)
        if op is ReduceOp.BXOR:
            return np.logical_xor.reduce(bits, 0)
        return bits.all(0)
    if op is ReduceOp.SUM:
        out = n * b + n * (n - 1) // 2
    elif op is ReduceOp.AVG:
        out = b + (n - 1) / 2
    elif op is ReduceOp.PREMUL_SUM:
        out = PREMUL_FACTOR * (n * b + n * (n - 1) // 2)
    elif op is ReduceOp.MIN:
        out = b
    elif op is ReduceOp.MAX:
        out = b + n - 1
    elif op is ReduceOp.PRODUCT:
        if _signed(dtype):   # one factor 2 times the signs: rank r is negative where b + r is odd
            odd_ranks, even_ranks = n // 2, (n + 1) // 2
            negatives = np.where(b & 1, even_ranks, odd_ranks)
            out = 2 * np.where(negatives & 1, -1, 1)
        else:
            out = np.full(count, 2)
    else:   # BAND / BOR / BXOR: fold rank by rank
        ufunc = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
                 ReduceOp.BXOR: np.bitwise_xor}[op]
        out = b.copy()
        for r in range(1, n):
            out = ufunc(out, b + r)
    return storage(out, dtype)


def block(count: int, tag: int) -> np.ndarray:
    """Data of a moved block, distinct per `tag` (e.g. source * size + destination)."""
    return pattern(count) + tag % 241
