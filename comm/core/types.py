"""Element types and reduction operators: the vocabulary every transport shares."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class DType(enum.IntEnum):
    """Element types. The integer values are the wire/engine codes: never renumber."""

    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2
    FLOAT64 = 3
    INT8 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    UINT8 = 8
    BOOL = 9

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_floating(self) -> bool:
        return self in (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)

    @property
    def numpy_storage(self) -> np.dtype:
        """The numpy dtype that holds the bits (bfloat16 has none, so uint16)."""
        return _STORAGE[self]


_ITEMSIZE = {DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT32: 4, DType.FLOAT64: 8,
             DType.INT8: 1, DType.INT16: 2, DType.INT32: 4, DType.INT64: 8,
             DType.UINT8: 1, DType.BOOL: 1}
_STORAGE = {DType.FLOAT16: np.dtype(np.float16), DType.BFLOAT16: np.dtype(np.uint16),
            DType.FLOAT32: np.dtype(np.float32), DType.FLOAT64: np.dtype(np.float64),
            DType.INT8: np.dtype(np.int8), DType.INT16: np.dtype(np.int16),
            DType.INT32: np.dtype(np.int32), DType.INT64: np.dtype(np.int64),
            DType.UINT8: np.dtype(np.uint8), DType.BOOL: np.dtype(np.bool_)}

# numpy dtype -> DType (bfloat16 only arrives through torch or DLPack).
NUMPY_TO_DTYPE = {v: k for k, v in _STORAGE.items() if k is not DType.BFLOAT16}


class ReduceOp(enum.IntEnum):
    """Reduction operators, named as torch.distributed names them. Values are engine codes."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8


@dataclass(frozen=True)
class PremulSum:
    """PREMUL_SUM with its factor: every rank scales its input by `factor`, then all sum."""

    factor: float
    op = ReduceOp.PREMUL_SUM


def premul_sum(factor: float) -> PremulSum:
    """The op argument for a scaled sum, e.g. ``world.all_reduce(g, op=comm.premul_sum(1/n))``."""
    return PremulSum(float(factor))


def op_allowed(op: ReduceOp, dtype: DType) -> bool:
    """Whether `op` is defined on `dtype` (checked before anything is sent)."""
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return not dtype.is_floating
    if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        return dtype.is_floating
    return True
