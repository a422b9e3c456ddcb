"""Inputs whose results are exactly predictable, and numpy references for every collective.

Every rank builds every rank's input from (case seed, rank), so each rank can check its own
result without extra communication. Values are small integers (or bits), so sums and
products are exact in every dtype, float16 and bfloat16 included.
"""
from __future__ import annotations

import importlib.util

import numpy as np

from comm.core.types import DType, ReduceOp, op_allowed

# numpy has no bfloat16: bfloat16 arrays come from torch. Without torch, bfloat16's cases run as
# float16 (the other 2-byte float, same code paths but the conversion) and the session header
# says so (conftest.py).
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def dtypes(*wanted: DType) -> list[DType]:
    """`wanted`, with bfloat16 as float16 where torch is missing (no dtype twice)."""
    here = (DType.FLOAT16 if d is DType.BFLOAT16 and not HAVE_TORCH else d for d in wanted)
    return list(dict.fromkeys(here))


ALL_DTYPES = dtypes(*DType)
INT_OPS = [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]


def ops_for(dtype: DType) -> list[ReduceOp]:
    return [op for op in ReduceOp if op_allowed(op, dtype)]


def values(dtype: DType, count: int, rank: int, seed: int, op: ReduceOp = ReduceOp.SUM) -> np.ndarray:
    """Rank `rank`'s input as float64 or int64 (exact in `dtype`)."""
    rng = np.random.default_rng([seed, rank, count, int(dtype)])
    if dtype is DType.BOOL:
        return rng.integers(0, 2, count).astype(np.int64)
    if op is ReduceOp.PRODUCT:
        v = rng.choice([1, 2] if dtype is DType.UINT8 else [-1, 1, 2], count)
        return v.astype(np.float64 if dtype.is_floating else np.int64)
    if op in INT_OPS:
        return rng.integers(0, 128, count).astype(np.int64)
    if dtype is DType.UINT8:
        return rng.integers(0, 40, count).astype(np.int64)
    return rng.integers(-20, 21, count).astype(np.float64 if dtype.is_floating else np.int64)


def reduce(arrays: list[np.ndarray], op: ReduceOp, dtype: DType, scale: float = 1.0) -> np.ndarray:
    """The reduction of exact per-rank values, as the collective must produce it."""
    stack = np.stack(arrays)
    if dtype is DType.BOOL:
        b = stack.astype(bool)
        if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR):
            return b.any(0).astype(np.int64)
        if op is ReduceOp.BXOR:
            return (np.bitwise_xor.reduce(b, 0)).astype(np.int64)
        return b.all(0).astype(np.int64)
    if op is ReduceOp.SUM:
        return stack.sum(0)
    if op is ReduceOp.PRODUCT:
        return stack.prod(0)
    if op is ReduceOp.MIN:
        return stack.min(0)
    if op is ReduceOp.MAX:
        return stack.max(0)
    if op is ReduceOp.AVG:
        return stack.sum(0) / len(arrays)
    if op is ReduceOp.PREMUL_SUM:
        return (stack * scale).sum(0)
    ufunc = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}[op]
    return ufunc.reduce(stack, 0)


def v_counts(n: int, seed: int, most: int) -> list[int]:
    """counts for a v-collective of n ranks: uneven, zeros included (seed 0: all zero but the
    last rank's)."""
    if seed == 0:
        return [0] * (n - 1) + [most]
    rng = np.random.default_rng([seed, n])
    counts = rng.integers(0, most + 1, n)
    counts[rng.integers(0, n)] = 0
    return [int(k) for k in counts]


def reduce_scatter_v(ins: list[np.ndarray], counts, rank: int, op: ReduceOp, dtype: DType,
                     scale: float = 1.0) -> np.ndarray:
    """Rank `rank`'s block of the reduction of every rank's whole input."""
    start = sum(counts[:rank])
    return reduce(ins, op, dtype, scale)[start:start + counts[rank]]


_TORCH = {DType.FLOAT16: "float16", DType.BFLOAT16: "bfloat16", DType.FLOAT32: "float32",
          DType.FLOAT64: "float64", DType.INT8: "int8", DType.INT16: "int16", DType.INT32: "int32",
          DType.INT64: "int64", DType.UINT8: "uint8", DType.BOOL: "bool"}


def make(v: np.ndarray, dtype: DType, kind: str = "numpy"):
    """An array of `dtype` holding v: numpy, or torch (bfloat16 always takes torch)."""
    if kind == "torch" or dtype is DType.BFLOAT16:
        import torch
        return torch.from_numpy(np.array(v)).to(getattr(torch, _TORCH[dtype]))  # a copy: never alias v
    return v.astype(dtype.numpy_storage)


def empty(count, dtype: DType, kind: str = "numpy", shape=None):
    shape = (count,) if shape is None else shape
    if kind == "torch" or dtype is DType.BFLOAT16:
        import torch
        return torch.full(shape, 99, dtype=getattr(torch, _TORCH[dtype]))
    return np.full(shape, 99, dtype=dtype.numpy_storage)


def as_f64(x) -> np.ndarray:
    """Any result array as flat float64/int64 numpy, for comparison."""
    if not isinstance(x, np.ndarray):
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.numpy()
    x = x.reshape(-1)
    if x.dtype == np.bool_:
        return x.astype(np.int64)
    return x.astype(np.float64) if x.dtype.kind == "f" else x.astype(np.int64)


def rounded(expected: np.ndarray, dtype: DType) -> np.ndarray:
    """Expected values as `dtype` stores them (AVG of integers in float16 rounds)."""
    return as_f64(make(expected, dtype))


def mismatch(got, expected: np.ndarray, dtype: DType, what: str) -> str | None:
    """None when equal (within one rounding of `dtype` for non-integral results)."""
    g = as_f64(got)
    e = rounded(expected, dtype) if dtype.is_floating else np.asarray(expected).reshape(-1)
    if g.shape != e.shape:
        return f"{what}: shape {g.shape} != {e.shape}"
    tol = {DType.FLOAT16: 2e-3, DType.BFLOAT16: 1e-2}.get(dtype, 1e-6)
    bad = ~np.isclose(g, e, rtol=tol, atol=tol) if dtype.is_floating else g != e
    if bad.any():
        i = int(np.argmax(bad))
        return f"{what}: {int(bad.sum())} wrong of {g.size}, first at {i}: got {g[i]}, want {e[i]}"
    return None
