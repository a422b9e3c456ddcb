"""Data in and out of compressed collectives' float32 workspaces: every partial sum is kept in
float32 (comm/compress.py), so data of another floating dtype is converted on the way in and
back on the way out, by the plan (comm/compress_plan.py) and by the engine's path alike, with
the same rounding as the engine's own results.
"""
from __future__ import annotations

import numpy as np

from .core.ops import OpDesc, OpKind
from .core.types import DType, ReduceOp

try:   # the kernels are the engine's; without it the other transports still run, uncompressed
    from . import _native as kernels
except ImportError:
    kernels = None


def _as_float32(data: np.ndarray, dtype: DType) -> np.ndarray:
    if dtype is DType.BFLOAT16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32, copy=False)


def load_float32(dst: np.ndarray, src, start: int, count: int, desc: OpDesc) -> None:
    """dst[:count] = float32 of src's elements [start, start + count), premultiplied for
    PREMUL_SUM; the rest of dst (padding) zero."""
    data = src.numpy()[start:start + count]
    dst[:count] = _as_float32(data, desc.dtype)
    dst[count:] = 0
    if desc.kind in (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.REDUCE_SCATTER_V) \
            and desc.op is ReduceOp.PREMUL_SUM and desc.scale != 1.0:
        dst[:count] *= np.float32(desc.scale)


def store_float32(out: np.ndarray, start: int, values: np.ndarray, dtype: DType) -> None:
    """out[start:start + values.size] = float32 `values` as `dtype` (out: the caller's buffer
    as numpy, of that dtype's storage)."""
    if dtype is DType.BFLOAT16:   # round to nearest even, as the engine's bf16 results
        packed = np.empty(values.size, np.uint16)
        kernels.compress_to_bf16(np.ascontiguousarray(values).ctypes.data, packed.ctypes.data, values.size)
        out[start:start + values.size] = packed
    elif values.size and out[start:].ctypes.data != values.ctypes.data:   # else: computed in place
        out[start:start + values.size] = values
