"""CUDA buffers on CPU transports (comm.staging) and CUDA array inputs (comm.core.buffers).

What needs no GPU runs everywhere: the routing of a CUDA buffer to the staged path (and its
refusal, communicator intact, when this process has no GPU), the pinned pool's size classes,
and the reading of DLPack capsules. The copies themselves run in tests/device/run.py."""
from __future__ import annotations

import numpy as np
import pytest

import comm
from comm.core import gpu
from comm import staging
from comm.core.buffers import as_buffer
from comm.core.ops import OpDesc, OpKind


class CudaArray:
    """A CUDA-array-interface producer with a pointer no process here can dereference: what a
    CuPy array looks like to the library. Nothing reads through it in these tests."""

    def __init__(self, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (0x7F0000000000, False),
                                         "version": 3, "strides": None}


def _gpu_reason() -> str | None:
    if gpu._cudart is None:
        return gpu.NO_BINDINGS
    err, n = gpu._cudart.cudaGetDeviceCount()
    return None if err == gpu._cudart.cudaError_t.cudaSuccess and n else "no CUDA device here"


GPU_REASON = _gpu_reason()


def _cuda_buffer_without_gpu(world):
    """A CUDA buffer on the native transport is routed to staging; without a GPU that is a
    clear InvalidArgument on this rank and the communicator keeps working."""
    try:
        world.all_reduce(CudaArray(8))
    except comm.InvalidArgument as e:
        message = str(e)
    else:
        message = None
    x = np.full(4, world.rank + 1.0, np.float32)
    world.all_reduce(x)
    return message, float(x[0])


@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present: tests/device/run.py covers the staged copies")
def test_cuda_buffer_on_cpu_transport_without_gpu_is_refused_cleanly():
    from harness import run_ranks
    for rank, (message, total) in enumerate(run_ranks(_cuda_buffer_without_gpu, 2)):
        assert message is not None and f"[rank {rank}] all_reduce" in message
        assert "native transport" in message and ("no device" in message or "cuda-bindings" in message)
        assert total == 3.0


def test_involves_only_cuda_buffers():
    host = as_buffer(np.zeros(4, np.float32), op="t", writable=True)
    dev = as_buffer(CudaArray(4), op="t", writable=True)
    assert not staging.Stager.involves(OpDesc(OpKind.ALL_REDUCE, host, host, host.dtype, 4))
    assert not staging.Stager.involves(OpDesc(OpKind.BARRIER))
    assert staging.Stager.involves(OpDesc(OpKind.ALL_REDUCE, dev, dev, dev.dtype, 4))
    assert staging.Stager.involves(OpDesc(OpKind.GATHER, dev, None, dev.dtype, 4))   # non-root gather


@pytest.mark.parametrize("nbytes, size", [(0, 4096), (1, 4096), (4096, 4096), (4097, 8192), (1 << 20, 1 << 20),
                                          ((1 << 20) + 1, 1 << 21)])
def test_pinned_pool_size_classes(nbytes, size):
    assert staging.PinnedPool.size_class(nbytes) == size


# ---- DLPack capsules on CUDA are read directly (numpy cannot import device memory) ---------------
class DLPackProducer:
    """Hands out a real (numpy) DLPack capsule while saying its memory is on CUDA, and records
    the stream the consumer asked for; the reading of the capsule is what is tested."""

    def __init__(self, a: np.ndarray):
        self.a, self.streams = a, []

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return (2, 0)   # kDLCUDA


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint8, np.bool_])
def test_cuda_dlpack_capsule_is_read_without_copy(dtype):
    a = np.arange(24).astype(dtype).reshape(2, 3, 4)
    producer = DLPackProducer(a)
    buf = as_buffer(producer, op="all_reduce", writable=True)
    assert buf.device == "cuda" and buf.ptr == a.ctypes.data
    assert buf.shape == (2, 3, 4) and buf.count == 24 and buf.dtype.name.lower() == np.dtype(dtype).name
    assert producer.streams == [1]               # the legacy default stream, in DLPack's spelling
    assert buf.obj[0] is producer                # the producer and its capsule live as long as the buffer


def test_cuda_dlpack_offsets_and_non_contiguous():
    a = np.arange(40, dtype=np.float64)
    buf = as_buffer(DLPackProducer(a[8:]), op="broadcast", writable=True)
    assert buf.ptr == a.ctypes.data + 8 * 8 and buf.count == 32
    with pytest.raises(comm.InvalidArgument, match="not contiguous"):
        as_buffer(DLPackProducer(a.reshape(8, 5)[:, :2]), op="broadcast", writable=True)
    with pytest.raises(comm.InvalidArgument, match="not supported"):
        as_buffer(DLPackProducer(np.zeros(3, np.complex64)), op="broadcast", writable=True)
