"""CUDA buffers without a CUDA transport: staged through pinned host memory.

Three things live here:

- Which transport CUDA buffers take (`cuda_transport`): nccl when it can run on every rank
  with a GPU of its own, else the CPU transport with staging. All ranks decide alike: each
  publishes its GPU's PCI bus id (or why it has none) through the store, and every rank reads
  the same records. Two ranks on one GPU (NCCL refuses that) or nccl4py missing on any rank
  sends every rank down the staged path, with a one-time notice.
- The staged path itself (`Stager`): a CUDA buffer handed to a CPU-only transport is copied
  into pinned host memory on the caller's current CUDA stream, the stream is synchronised
  (the CPU transport reads the copy at once), the host operation runs, and on completion the
  output is copied back and the stream synchronised again before completion is reported, so
  a caller that waited may read the result from any stream.
- The same copies for one-sided windows (`WindowStaging`, used by comm.window): a put's CUDA
  source is copied down before the host put starts; a get lands in a pinned block that the
  flush completing it copies up.

This sits above the transports (it asks their registry whether nccl can run, and posts to a
CPU transport); the CUDA calls and the GPU records it shares with the nccl transport are in
comm.core.gpu, below both.
"""
from __future__ import annotations

import dataclasses
import threading

from transports import base

from .core.buffers import Buffer
from .core.errors import CommError, TransportUnavailable
from .core.gpu import (NO_BINDINGS, _cudart, cuda_check, current_stream, decode_record, encode_record, gpu_problem,
                       notice_once, pci_bus_id)
from .core.ops import OpDesc, Request

def cuda_transport(store, cpu_transport: str, device: int | None) -> str:
    """The transport for CUDA buffers, the same on every rank of the group behind `store`:
    "nccl" when nccl runs on every rank and each has its own GPU, else `cpu_transport` (the
    Communicator then stages CUDA buffers), said once on stderr. `device` is this rank's CUDA
    device (None: the current one)."""
    reason = base.unavailable_reason("nccl")
    bus = None
    if reason is None:
        try:
            bus = pci_bus_id(cuda_check(_cudart.cudaGetDevice(), "cudaGetDevice") if device is None else device)
        except CommError as e:
            reason = e.cause
    records = [decode_record(r) for r in store.all_gather("cuda/transport", encode_record(bus, reason))]
    problem = gpu_problem(records)
    if problem is None:
        return "nccl"
    notice_once(f"CUDA tensors go through pinned host memory over the {cpu_transport} transport, "
                f"because nccl cannot serve every rank ({problem})")
    return cpu_transport


# ---- the staged path ------------------------------------------------------------------------------
class PinnedPool:
    """Page-locked host blocks by power-of-two size, reused across operations (cudaMallocHost
    costs far more than a copy)."""

    def __init__(self, keep_per_size: int = 4):
        self._free: dict[int, list[int]] = {}
        self._keep = keep_per_size
        self._lock = threading.Lock()

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(4096, 1 << (max(nbytes, 1) - 1).bit_length())

    def take(self, nbytes: int) -> tuple[int, int]:
        size = self.size_class(nbytes)
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                return blocks.pop(), size
        return cuda_check(_cudart.cudaMallocHost(size), "cudaMallocHost"), size

    def give(self, ptr: int, size: int) -> None:
        with self._lock:
            blocks = self._free.setdefault(size, [])
            if len(blocks) < self._keep:
                blocks.append(ptr)
                return
        _cudart.cudaFreeHost(ptr)

    def close(self) -> None:
        with self._lock:
            blocks, self._free = [p for b in self._free.values() for p in b], {}
        for ptr in blocks:
            _cudart.cudaFreeHost(ptr)


def require_cuda() -> None:
    """TransportUnavailable unless cuda-bindings loads and this process sees a CUDA device."""
    if _cudart is None:
        raise TransportUnavailable(NO_BINDINGS)
    try:
        err, count = _cudart.cudaGetDeviceCount()
    except RuntimeError as e:   # cuda-bindings could not load a CUDA library
        raise TransportUnavailable(f"CUDA cannot start in this process ({e})") from None
    if err != _cudart.cudaError_t.cudaSuccess or count == 0:
        why = f" ({_cudart.cudaGetErrorName(err)[1].decode()})" if err != _cudart.cudaError_t.cudaSuccess else ""
        raise TransportUnavailable(f"CUDA reports no device in this process{why}")


def _within(inner: Buffer, outer: Buffer) -> bool:
    return outer.ptr <= inner.ptr and inner.ptr + inner.nbytes <= outer.ptr + outer.nbytes


class Stager:
    """Posts operations whose buffers are on CUDA to a transport that only reaches host memory."""

    def __init__(self, post, name: str):
        """`post(desc, blocking) -> Request` runs host operations; `name` is what it is, for the
        notice."""
        require_cuda()
        self._post = post
        self._pool = PinnedPool()
        self._pending: list[StagedRequest] = []   # async operations not yet copied back
        notice_once(f"CUDA buffers on {name} are staged through pinned host memory "
                    "(a copy each way per operation)")

    @staticmethod
    def involves(desc: OpDesc) -> bool:
        return (desc.send is not None and desc.send.device == "cuda") or \
            (desc.recv is not None and desc.recv.device == "cuda")

    def post(self, desc: OpDesc, blocking: bool) -> Request:
        # Earlier operations copy their outputs back first, in posting order: a later one must
        # read what they wrote (stream order, as over NCCL), and an earlier copy-back must never
        # land over a later result. Their errors surface here, as the transport's would.
        pending, self._pending = self._pending, []
        for earlier in pending:
            earlier.wait(None)
        cuda = desc.recv if desc.recv is not None and desc.recv.device == "cuda" else desc.send
        staged = _Staged.on(self._pool, cuda)
        try:
            host = staged.down(desc)
            staged.synchronize()
            req = self._post(host, blocking)
        except BaseException:
            staged.release()
            raise
        request = StagedRequest(req, staged)
        if not blocking:
            self._pending.append(request)
        return request

    def close(self) -> None:
        self._pool.close()


class WindowStaging:
    """CUDA sources and destinations of one-sided puts and gets (comm.window) over windows of
    host memory: a put's source is copied into a pinned block, synchronised, before the host
    put starts from the block; a get lands in a block that the flush completing it copies up.
    Each call returns its _Staged, which the window holds until that flush: back() then copies
    a get's block to the GPU (synchronised) and gives the blocks back; abandon() after a
    failure, when the transport may still touch them."""

    def __init__(self):
        require_cuda()
        # many puts in flight before one flush is the KV-transfer pattern: keep their blocks
        self._pool = PinnedPool(keep_per_size=32)
        notice_once("CUDA buffers in windows are staged through pinned host memory (each put copies "
                    "its source to the host first; each get is copied to the GPU by the flush that "
                    "completes it)")

    def put_source(self, src: Buffer) -> tuple[_Staged, Buffer]:
        """(the staging, the host copy of `src`, already complete)."""
        staged = _Staged.on(self._pool, src)
        try:
            host = staged._host(src, copy=True)
            staged.synchronize()
        except BaseException:
            staged.release()
            raise
        return staged, host

    def get_target(self, dst: Buffer) -> tuple[_Staged, Buffer]:
        """(the staging, the host block the get lands in; back() copies it to `dst`)."""
        staged = _Staged.on(self._pool, dst)
        return staged, staged.output(dst)

    def close(self) -> None:
        self._pool.close()


class _Staged:
    """The pinned copies of one operation's CUDA buffers and the copy back of its output."""

    def __init__(self, pool: PinnedPool, device: int, stream: int):
        self._pool, self._device, self._stream = pool, device, stream
        self._blocks: list[tuple[int, int]] = []
        self._out: tuple[Buffer, Buffer] | None = None   # (CUDA destination, host copy)

    @classmethod
    def on(cls, pool: PinnedPool, cuda: Buffer) -> "_Staged":
        """Copies for an operation on `cuda`'s device, on the caller's current stream there."""
        cuda_check(_cudart.cudaSetDevice(cuda.device_index), "cudaSetDevice")
        return cls(pool, cuda.device_index, current_stream(cuda.device_index))

    def synchronize(self) -> None:
        """Wait for the copies queued so far (a host transport reads the copies at once)."""
        cuda_check(_cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def output(self, buf: Buffer, copy: bool = False) -> Buffer:
        """The host copy of CUDA output `buf`, copied up by back() (down as well with `copy`:
        an output that is also read)."""
        host = self._host(buf, copy)
        self._out = (buf, host)
        return host

    def _host(self, buf: Buffer, copy: bool) -> Buffer:
        ptr, size = self._pool.take(buf.nbytes)
        self._blocks.append((ptr, size))
        if copy and buf.nbytes:
            cuda_check(_cudart.cudaMemcpyAsync(ptr, buf.ptr, buf.nbytes,
                                               _cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream),
                       "cudaMemcpyAsync (device to host)")
        return Buffer(ptr, buf.count, buf.dtype, buf.shape, "cpu", 0, False, None)

    def down(self, desc: OpDesc) -> OpDesc:
        """desc with host copies of its CUDA buffers (copies queued on the stream). An input
        inside the output (in-place forms) becomes a view of the output's copy, so the host
        operation sees the same aliasing; an output alone is not copied down (it is written)."""
        send, recv = desc.send, desc.recv
        host_recv = host_send = None
        if recv is not None and recv.device == "cuda":
            inplace = send is not None and _within(send, recv)
            host_recv = self.output(recv, copy=inplace)
            if inplace:
                host_send = host_recv.view((send.ptr - recv.ptr) // send.dtype.itemsize, send.count)
        if send is not None and host_send is None:
            host_send = self._host(send, copy=True) if send.device == "cuda" else send
        return dataclasses.replace(desc, send=host_send, recv=host_recv if host_recv is not None else recv)

    def back(self) -> None:
        """Copy the output up and wait for it: completion is reported only once the data is on
        the GPU (the host copy is released right after)."""
        try:
            if self._out is not None and self._out[0].nbytes:
                dst, src = self._out
                cuda_check(_cudart.cudaSetDevice(self._device), "cudaSetDevice")
                cuda_check(_cudart.cudaMemcpyAsync(dst.ptr, src.ptr, dst.nbytes,
                                                   _cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self._stream),
                           "cudaMemcpyAsync (host to device)")
                cuda_check(_cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
        finally:
            self.release()

    def release(self) -> None:
        blocks, self._blocks = self._blocks, []
        for ptr, size in blocks:
            self._pool.give(ptr, size)

    def abandon(self) -> None:
        """After a failed or timed-out operation the transport may still write into the host
        copies: they are never reused (the communicator takes no more work anyway)."""
        self._blocks, self._out = [], None


class StagedRequest(Request):
    """The host operation's request; completes once the output is back on the GPU."""

    __slots__ = ("_req", "_staged", "_done", "_lock")

    def __init__(self, req: Request, staged: _Staged):
        self._req, self._staged, self._done = req, staged, False
        self._lock = threading.Lock()

    def _finish(self) -> None:
        with self._lock:   # the waiter and a poller may both see the host op complete
            if not self._done:
                self._done = True
                self._staged.back()

    def test(self) -> bool:
        if self._done:
            return True
        try:
            if not self._req.test():
                return False
        except BaseException:
            self._staged.abandon()
            raise
        self._finish()
        return True

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            try:
                self._req.wait(timeout)
            except BaseException:
                self._staged.abandon()
                raise
            self._finish()
