"""Array-neutral buffers: numpy, torch (CPU/CUDA), DLPack and __cuda_array_interface__, no copies.

A `Buffer` is what transports see: a pointer, an element count, a dtype and the device. The
array object it came from is kept alive in `obj` for as long as an operation uses the buffer.
torch is never imported here: tensors are recognised by their type's module.
"""
from __future__ import annotations

import ctypes
import numpy as np

from .errors import InvalidArgument
from .types import NUMPY_TO_DTYPE, DType

_TORCH_DTYPES = {"torch.float16": DType.FLOAT16, "torch.bfloat16": DType.BFLOAT16,
                 "torch.float32": DType.FLOAT32, "torch.float64": DType.FLOAT64,
                 "torch.int8": DType.INT8, "torch.int16": DType.INT16, "torch.int32": DType.INT32,
                 "torch.int64": DType.INT64, "torch.uint8": DType.UINT8, "torch.bool": DType.BOOL}
_TYPESTR = {"<f2": DType.FLOAT16, "<f4": DType.FLOAT32, "<f8": DType.FLOAT64, "|i1": DType.INT8,
            "<i2": DType.INT16, "<i4": DType.INT32, "<i8": DType.INT64, "|u1": DType.UINT8,
            "|b1": DType.BOOL}


class Buffer:
    """Where an array's elements are. A plain slotted class: it is built on every call, and a
    frozen dataclass costs microseconds there."""

    __slots__ = ("ptr", "count", "dtype", "shape", "device", "device_index", "readonly", "obj")

    def __init__(self, ptr: int, count: int, dtype: DType, shape: tuple, device: str = "cpu",
                 device_index: int = 0, readonly: bool = False, obj: object = None):
        self.ptr = ptr
        self.count = count
        self.dtype = dtype
        self.shape = shape
        self.device = device
        self.device_index = device_index
        self.readonly = readonly
        self.obj = obj

    def __repr__(self) -> str:
        return (f"Buffer(ptr={self.ptr:#x}, count={self.count}, dtype={self.dtype.name}, "
                f"shape={self.shape}, device={self.device}:{self.device_index})")

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def view(self, offset: int, count: int) -> "Buffer":
        """Elements [offset, offset + count) as a flat buffer."""
        return Buffer(self.ptr + offset * self.dtype.itemsize, count, self.dtype, (count,),
                      self.device, self.device_index, self.readonly, self.obj)

    def numpy(self) -> np.ndarray:
        """A flat numpy view of the storage (bfloat16 as uint16); CPU only, no copy."""
        if self.device != "cpu":
            raise InvalidArgument(f"a {self.device} buffer has no numpy view")
        storage = self.dtype.numpy_storage
        if self.count == 0:
            return np.empty(0, storage)
        raw = (ctypes.c_uint8 * self.nbytes).from_address(self.ptr)
        arr = np.frombuffer(raw, dtype=storage)
        if self.readonly:
            arr.flags.writeable = False
        return arr


def _bad(op: str, what: str) -> InvalidArgument:
    return InvalidArgument(what, op=op)


def _array_interface_address(a: np.ndarray) -> tuple[int, bool, bool]:
    return a.__array_interface__["data"][0], not a.flags.writeable, a.flags.c_contiguous


try:  # the buffer protocol read from C is the cheap way; the engine's module provides it
    from .._native import buffer_address as _address
except ImportError:
    _address = _array_interface_address


def _from_numpy(a: np.ndarray, op: str, obj=None) -> Buffer:
    dtype = NUMPY_TO_DTYPE.get(a.dtype)
    if dtype is None:
        raise _bad(op, f"dtype {a.dtype} is not supported (use float16/32/64, int8..int64, uint8, bool; "
                       "bfloat16 through torch)")
    ptr, readonly, contiguous = _address(a)
    if not contiguous:
        raise _bad(op, f"array of shape {a.shape} is not contiguous; pass np.ascontiguousarray(x)")
    return Buffer(ptr, a.size, dtype, a.shape, "cpu", 0, readonly, a if obj is None else obj)


def _from_torch(t, op: str) -> Buffer:
    dtype = _TORCH_DTYPES.get(str(t.dtype))
    if dtype is None:
        raise _bad(op, f"dtype {t.dtype} is not supported")
    try:  # sparse, mkldnn and nested tensors have no plain memory: torch raises on these
        contiguous, ptr, count, shape = t.is_contiguous(), t.data_ptr(), t.numel(), tuple(t.shape)
        storage_bytes, offset, negated = t.untyped_storage().nbytes(), t.storage_offset(), t.is_neg()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise _bad(op, f"a {t.layout} {type(t).__name__} has no plain memory to use ({e})") from None
    if not contiguous:
        raise _bad(op, f"tensor of shape {shape} is not contiguous; pass x.contiguous()")
    if count and not ptr:  # FakeTensor, meta, or storage freed (FSDP frees parameters so)
        what = "a FakeTensor" if type(t).__name__ == "FakeTensor" else f"a {t.device.type} tensor"
        raise _bad(op, f"{what} of shape {shape} has no memory (no data, or its storage was "
                       "freed / resized to 0)")
    need = (offset + count) * dtype.itemsize
    if count and storage_bytes < need:  # the engine would read or write past the storage
        raise _bad(op, f"tensor of shape {shape} needs {need} bytes of storage but its storage "
                       f"holds {storage_bytes} (was it resized?)")
    if negated:  # the memory holds -x: sending it would be silently wrong
        raise _bad(op, "tensor is a lazy negation view; pass x.resolve_neg()")
    dev = t.device
    return Buffer(ptr, count, dtype, shape, dev.type, dev.index or 0, False, t)


def _from_cai(x, op: str) -> Buffer:
    cai = x.__cuda_array_interface__
    dtype = _TYPESTR.get(cai["typestr"])
    if dtype is None:
        raise _bad(op, f"CUDA array type {cai['typestr']} is not supported")
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    count = int(np.prod(shape)) if shape else 1
    if strides is not None:
        expect, want = dtype.itemsize, []
        for dim in reversed(shape):
            want.append(expect)
            expect *= dim
        if tuple(reversed(want)) != tuple(strides) and count > 1:
            raise _bad(op, "CUDA array is not contiguous")
    if cai.get("mask") is not None:
        raise _bad(op, "masked CUDA arrays are not supported")
    ptr, readonly = cai["data"]
    if count and not ptr:
        raise _bad(op, f"CUDA array of shape {shape} has no memory (null data pointer)")
    return Buffer(ptr, count, dtype, shape, "cuda", _cuda_ordinal(ptr), bool(readonly), x)


try:  # optional: which GPU a raw CUDA pointer lives on (CUDA-array-interface and DLPack inputs)
    from cuda.bindings import driver as _cu
except ImportError:
    _cu = None


def _cuda_ordinal(ptr: int) -> int:
    """The CUDA device index owning `ptr` (the interfaces do not say); 0 when it cannot be asked."""
    if _cu is None or not ptr:
        return 0
    try:
        err, ordinal = _cu.cuPointerGetAttribute(_cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    except RuntimeError:   # no driver library in this process (cuda-pathfinder raises)
        return 0
    return int(ordinal) if int(err) == 0 else 0


# ---- DLPack on CUDA: numpy cannot import device memory, so the capsule is read directly --------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DL_CUDA, _DL_CUDA_MANAGED = 2, 13   # DLDeviceType codes whose memory is a CUDA pointer
_DL_DTYPES = {(2, 16): DType.FLOAT16, (2, 32): DType.FLOAT32, (2, 64): DType.FLOAT64,
              (4, 16): DType.BFLOAT16, (0, 8): DType.INT8, (0, 16): DType.INT16, (0, 32): DType.INT32,
              (0, 64): DType.INT64, (1, 8): DType.UINT8, (6, 8): DType.BOOL}
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def _from_cuda_dlpack(x, op: str, device_id: int) -> Buffer:
    """A CUDA DLPack array. The capsule is read, not consumed: it stays in Buffer.obj, so the
    producer's deleter runs when the buffer is dropped. The producer orders its pending work
    before our current stream (the `stream` argument of the protocol)."""
    from .gpu import current_stream
    stream = current_stream(device_id) or 1   # DLPack spells the legacy default stream 1
    try:
        capsule = x.__dlpack__(stream=stream)
        t = _DLTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    except (BufferError, TypeError, ValueError, RuntimeError) as e:
        raise _bad(op, f"cannot import {type(x).__name__} through DLPack: {e}") from None
    dtype = _DL_DTYPES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    if dtype is None:
        raise _bad(op, f"DLPack type code {t.dtype.code}, {t.dtype.bits} bits x {t.dtype.lanes} is not supported")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    count = int(np.prod(shape)) if shape else 1
    if count and not t.data:
        raise _bad(op, f"DLPack array of shape {shape} has no memory (null data pointer)")
    if t.strides and count > 1:
        expect = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and t.strides[i] != expect:
                raise _bad(op, "DLPack array is not contiguous")
            expect *= shape[i]
    return Buffer((t.data or 0) + t.byte_offset, count, dtype, shape, "cuda", t.device.device_id, False,
                  (x, capsule))


def as_buffer(x, *, op: str, writable: bool) -> Buffer:
    """The Buffer behind array `x`; InvalidArgument if it cannot be used without a copy."""
    if type(x) is np.ndarray or isinstance(x, np.ndarray):
        buf = _from_numpy(x, op)
    elif type(x).__module__.startswith("torch"):
        buf = _from_torch(x, op)
    elif hasattr(x, "__cuda_array_interface__"):
        buf = _from_cai(x, op)
    elif hasattr(x, "__dlpack__"):
        kind, index = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else (1, 0)
        if kind in (_DL_CUDA, _DL_CUDA_MANAGED):
            return _checked(_from_cuda_dlpack(x, op, index), op, writable)
        try:
            arr = np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as e:
            raise _bad(op, f"cannot import {type(x).__name__} through DLPack: {e}") from None
        buf = _from_numpy(arr, op, obj=(arr, x))
    elif isinstance(x, (bytearray, memoryview)):
        buf = _from_numpy(np.asarray(x if isinstance(x, memoryview) else memoryview(x)), op, obj=x)
    else:
        raise _bad(op, f"expected an array (numpy, torch, DLPack), got {type(x).__name__}")
    return _checked(buf, op, writable)


def _checked(buf: Buffer, op: str, writable: bool) -> Buffer:
    if writable and buf.readonly:
        raise _bad(op, "the output buffer is read-only")
    return buf
