"""NCCL transport: NVIDIA's collectives on CUDA buffers, through nccl4py's low-level bindings.

One communicator per process, on one CUDA device. The ranks exchange their GPUs' PCI bus ids
before NCCL is entered, so a rank without a GPU, or two ranks on one, is an error everywhere
instead of a hang in ncclCommInitRank. The communicator is non-blocking, so every call is
polled against the timeout. Streams follow torch's NCCL backend. What NCCL cannot do (tags,
int16, bitwise ops) is refused, never emulated: docs/transports.md (nccl) has the details.
"""
from __future__ import annotations

import struct
import sys

import numpy as np

from comm.core import gpu
from comm.core.buffers import Buffer
from comm.core.errors import (Aborted, Closed, CommError, CommTimeout, InvalidArgument, PeerFailure,
                              TransportUnavailable)
from comm.core.gpu import cuda_check as _cuda_check
from comm.core.types import DType, ReduceOp

from .base import BootstrapContext, OpDesc, OpKind, Request, Transport, poll_until, register

try:  # optional: the nccl-cu12 / nccl-cu13 extra
    from cuda.bindings import runtime as _cudart
    from nccl.bindings import nccl as _nccl
    _IMPORT_ERROR: str | None = None
except ImportError as e:
    _cudart = _nccl = None
    _IMPORT_ERROR = (f"nccl4py is not installed ({e.name} missing); install the nccl-cu12 extra "
                     "(pip install '.[nccl-cu12]'), or nccl-cu13 on a CUDA 13 stack")

# ncclDataType_t codes (nccl.h; stable C ABI). NCCL has no int16; bool travels as uint8.
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 0, 1, 2, 4
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_DTYPE: dict[DType, int] = {
    DType.INT8: NCCL_INT8, DType.UINT8: NCCL_UINT8, DType.BOOL: NCCL_UINT8,
    DType.INT32: NCCL_INT32, DType.INT64: NCCL_INT64, DType.FLOAT16: NCCL_FLOAT16,
    DType.FLOAT32: NCCL_FLOAT32, DType.FLOAT64: NCCL_FLOAT64, DType.BFLOAT16: NCCL_BFLOAT16,
}

# ncclRedOp_t codes. PREMUL_SUM has no fixed code: ncclRedOpCreatePreMulSum makes one per call.
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_OP: dict[ReduceOp, int] = {ReduceOp.SUM: NCCL_SUM, ReduceOp.PRODUCT: NCCL_PROD,
                                ReduceOp.MAX: NCCL_MAX, ReduceOp.MIN: NCCL_MIN, ReduceOp.AVG: NCCL_AVG}
# On 0/1 bytes, or = max and and = min (a uint8 sum of two `True`s would give 2, not 1).
_BOOL_OP = {ReduceOp.SUM: NCCL_MAX, ReduceOp.MAX: NCCL_MAX, ReduceOp.BOR: NCCL_MAX,
            ReduceOp.PRODUCT: NCCL_MIN, ReduceOp.MIN: NCCL_MIN, ReduceOp.BAND: NCCL_MIN}

_RESULT_SUCCESS, _RESULT_SYSTEM_ERROR, _RESULT_REMOTE_ERROR, _RESULT_IN_PROGRESS = 0, 2, 6, 7
_SCALAR_HOST_IMMEDIATE = 1   # ncclScalarHostImmediate: the factor is read before create returns
_NOCOLOR = -1                # NCCL_SPLIT_NOCOLOR


def reduction_types(dtype: DType, op: ReduceOp) -> tuple[int, int | None]:
    """(ncclDataType, ncclRedOp) for reducing `dtype` with `op`; the op is None for PREMUL_SUM,
    which is created per call. InvalidArgument when NCCL cannot do it."""
    if dtype is DType.BOOL:
        if op not in _BOOL_OP:
            raise InvalidArgument(f"NCCL cannot reduce bool with {op.name}")
        return NCCL_UINT8, _BOOL_OP[op]
    if dtype not in NCCL_DTYPE:
        raise InvalidArgument(f"NCCL has no {dtype.name.lower()} type for reductions; "
                              "use int32 or another transport")
    if op is ReduceOp.PREMUL_SUM:
        return NCCL_DTYPE[dtype], None
    if op not in NCCL_OP:
        raise InvalidArgument(f"NCCL has no {op.name} reduction; use another transport")
    return NCCL_DTYPE[dtype], NCCL_OP[op]


def premul_scalar(dtype: DType, factor: float) -> np.ndarray:
    """The PREMUL_SUM factor as one element of the reduction's type (NCCL reads it as such)."""
    if dtype is DType.BFLOAT16:  # no numpy bfloat16: the engine's kernel rounds 1.0 * factor
        from comm import _native
        one = np.array([0x3F80], np.uint16)  # bfloat16 1.0
        _native.scale(dtype, one.ctypes.data, one.ctypes.data, 1, factor)
        return one
    return np.array([factor], dtype.numpy_storage)




def choose_device(count: int, current: int, local_rank: int) -> int:
    """This rank's CUDA device: the only one it sees (one GPU per process through
    CUDA_VISIBLE_DEVICES or Slurm), else the current device when the process chose one (it is
    0 until set), else the local rank. TransportUnavailable when none fits."""
    if count < 1:
        raise TransportUnavailable("no CUDA device")
    if count == 1:
        return 0
    if current != 0:
        return current
    if local_rank < count:
        return local_rank
    raise TransportUnavailable(f"local rank {local_rank} would take CUDA device {local_rank}, but this "
                               f"process sees {count}; call torch.cuda.set_device() or set "
                               "CUDA_VISIBLE_DEVICES so each rank has one")


def _poll(state, timeout: float, what: str) -> int:
    """Poll state() while NCCL says ncclInProgress; the final state, or CommTimeout."""
    last = [_RESULT_IN_PROGRESS]

    def finished() -> bool:
        last[0] = state()
        return last[0] != _RESULT_IN_PROGRESS
    poll_until(finished, timeout, lambda: CommTimeout(f"NCCL {what} did not finish within {timeout:g} s "
                                                       "(a rank did not arrive, or is hung)"))
    return last[0]


class NcclRequest(Request):
    """An enqueued NCCL call, complete when the CUDA event recorded after it has fired."""

    __slots__ = ("_transport", "_event", "_keep")

    def __init__(self, transport: "NcclTransport", event, keep):
        self._transport = transport
        self._event = event
        self._keep = keep  # the buffers' arrays stay alive until the GPU is done with them

    def test(self) -> bool:
        if self._event is None:
            return True
        self._transport._check()
        err, = _cudart.cudaEventQuery(self._event)
        if err == _cudart.cudaError_t.cudaErrorNotReady:
            return False
        _cudart.cudaEventDestroy(self._event)
        self._event, self._keep = None, None
        if err != _cudart.cudaError_t.cudaSuccess:
            raise CommError(f"CUDA reported {_cudart.cudaGetErrorName(err)[1].decode()} for an NCCL call")
        return True

    def stream_wait(self) -> None:
        """Make the caller's current stream wait for the operation; the host does not block."""
        event = self._event
        if event is not None:
            device = self._transport._device
            _cuda_check(_cudart.cudaSetDevice(device), "cudaSetDevice")
            _cuda_check(_cudart.cudaStreamWaitEvent(gpu.current_stream(device), event, 0),
                        "cudaStreamWaitEvent")

    def wait(self, timeout: float | None = None) -> None:
        poll_until(self.test, timeout, lambda: self._timed_out(timeout))

    def _timed_out(self, timeout: float) -> CommTimeout:
        # A kernel waiting on a dead or hung peer never finishes: abort so the GPU and the
        # stream are freed; the communicator is poisoned by the timeout anyway.
        self._transport._fail_abort()
        return CommTimeout(f"NCCL operation not completed within {timeout:g} s (a peer is slow, hung, "
                           "dead, or called a different collective)")


@register
class NcclTransport(Transport):
    name = "nccl"
    elastic = ("NCCL makes its own communicators (ncclCommShrink would be the way); this transport "
               "does not drive it: shrink the CPU communicator and make a new nccl one from it")
    devices = frozenset({"cuda"})

    @classmethod
    def available(cls) -> str | None:
        if _IMPORT_ERROR is not None:
            return _IMPORT_ERROR
        try:  # nccl4py loads libnccl on first use: a missing or broken library shows here
            _nccl.get_version()
        except Exception as e:  # noqa: BLE001 - whatever the loader raises is the reason
            return f"nccl4py cannot load the NCCL library ({type(e).__name__}: {e})"
        err, n = _cudart.cudaGetDeviceCount()
        if err != _cudart.cudaError_t.cudaSuccess or n == 0:
            why = "" if err == _cudart.cudaError_t.cudaSuccess else \
                f" ({_cudart.cudaGetErrorName(err)[1].decode()})"
            return f"no CUDA device{why}"
        return None

    def __init__(self, ctx: BootstrapContext, comm, device: int):
        self.rank, self.size = ctx.rank, ctx.size
        self._ctx = ctx
        self._comm = comm
        self._device = device
        self._timeout = ctx.timeout
        self._aborted = False
        self._closed = False
        self._splits = 0
        _cuda_check(_cudart.cudaSetDevice(device), "cudaSetDevice")
        self._scratch = _cuda_check(_cudart.cudaMalloc(4), "cudaMalloc")  # barrier's all-reduce
        # The internal stream, as the integer handle nccl4py's calls take. With torch loaded it
        # is one of torch's pooled streams: tensors used on it are record_stream()ed, and torch's
        # allocator records events on that stream whenever such a tensor is freed, which may be
        # after close(); a stream of torch's pool is never destroyed, one of ours would be.
        torch = sys.modules.get("torch")
        self._torch_stream = torch.cuda.Stream(device=device) if torch is not None else None
        self._stream = (self._torch_stream.cuda_stream if self._torch_stream is not None else
                        int(_cuda_check(_cudart.cudaStreamCreateWithFlags(_cudart.cudaStreamNonBlocking),
                                        "cudaStreamCreate")))
        self._ready = _cuda_check(_cudart.cudaEventCreateWithFlags(_cudart.cudaEventDisableTiming),
                                  "cudaEventCreate")   # "the caller's stream got here", reused

    @classmethod
    def create(cls, ctx: BootstrapContext) -> "NcclTransport":
        reason = cls.available()
        if reason is not None:
            raise TransportUnavailable(reason, rank=ctx.rank, op="init")
        device, bus, uid, why = None, None, b"", None
        try:
            device = ctx.options.get("cuda_device")
            if device is None:
                device = cls._local_device(ctx)
            bus = gpu.pci_bus_id(device)
            if ctx.rank == 0:
                uid = bytes(cls._nccl_call(_nccl.get_unique_id, 0, "init"))
        except CommError as e:
            why = e.cause
        # Everyone learns everyone's GPU (or failure) before anyone enters NCCL: a rank that
        # failed here would otherwise leave the others in ncclCommInitRank for ever.
        records = [gpu.decode_record(r) for r in
                   ctx.store.all_gather("nccl/gpus", gpu.encode_record(bus, why, uid))]
        problem = gpu.gpu_problem(records)
        if problem is not None:
            raise TransportUnavailable(f"nccl cannot start: {problem}", rank=ctx.rank, op="init")
        raw_uid = bytearray(records[0][2])   # from_buffer wraps this memory: keep it alive
        uid = _nccl.UniqueId.from_buffer(raw_uid)
        _cuda_check(_cudart.cudaSetDevice(device), "cudaSetDevice")
        config = _nccl.Config()   # NCCL_CONFIG_INITIALIZER's defaults
        config.blocking = 0
        comm = cls._nccl_call(lambda: _nccl.comm_init_rank_config(ctx.size, uid, ctx.rank, config.ptr),
                              ctx.rank, "init")
        cls._settle(comm, ctx.timeout, ctx.rank, "init")
        return cls(ctx, comm, device)

    @staticmethod
    def _local_device(ctx: BootstrapContext) -> int:
        """choose_device with this host's rank count (ranks sharing our host_id before us)."""
        hosts = ctx.store.all_gather("nccl/host", ctx.host_id.encode())
        local = sum(1 for h in hosts[:ctx.rank] if h == ctx.host_id.encode())
        count = _cuda_check(_cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
        current = _cuda_check(_cudart.cudaGetDevice(), "cudaGetDevice")
        return choose_device(count, current, local)

    @staticmethod
    def _nccl_call(fn, rank: int | None, op: str | None):
        """fn() with NCCL's errors as CommError subclasses (a lost peer: PeerFailure)."""
        try:
            return fn()
        except _nccl.NCCLError as e:
            cls = PeerFailure if e.status in (_RESULT_REMOTE_ERROR, _RESULT_SYSTEM_ERROR) else CommError
            raise cls(f"NCCL: {e}", rank=rank, op=op) from None

    @staticmethod
    def _settle(comm, timeout: float, rank: int | None, op: str) -> None:
        """Wait until a non-blocking call on `comm` has finished; abort the communicator and
        raise if it failed or did not finish within `timeout`."""
        try:
            state = _poll(lambda: _nccl.comm_get_async_error(comm), timeout, op)
        except CommTimeout as e:
            _nccl.comm_abort(comm)
            raise e.locate(rank, op) from None
        if state != _RESULT_SUCCESS:
            detail = _nccl.get_last_error(comm) or _nccl.get_error_string(state)
            _nccl.comm_abort(comm)
            cls = PeerFailure if state in (_RESULT_REMOTE_ERROR, _RESULT_SYSTEM_ERROR) else CommError
            raise cls(f"NCCL {op} failed: {detail}", rank=rank, op=op)

    # ---- failure detection ---------------------------------------------------------------
    def _check(self) -> None:
        """Raise if the communicator was aborted, closed, or NCCL reports an asynchronous error."""
        if self._aborted:
            raise Aborted("the NCCL communicator was aborted")
        if self._closed:
            raise Closed("the NCCL communicator is closed")
        state = _nccl.comm_get_async_error(self._comm)
        if state in (_RESULT_SUCCESS, _RESULT_IN_PROGRESS):
            return
        detail = _nccl.get_last_error(self._comm) or _nccl.get_error_string(state)
        self._fail_abort()
        if state in (_RESULT_REMOTE_ERROR, _RESULT_SYSTEM_ERROR):
            raise PeerFailure(f"NCCL lost a peer: {detail}")
        raise CommError(f"NCCL failed: {detail}")

    def _fail_abort(self) -> None:
        if not self._aborted and not self._closed:
            self.abort()

    # ---- operations ------------------------------------------------------------------------
    def post(self, desc: OpDesc, blocking: bool) -> Request:
        self._check()
        if desc.kind in (OpKind.SEND, OpKind.RECV) and desc.tag != 0:
            raise InvalidArgument(f"tag {desc.tag}: NCCL has no tags (it matches messages per peer in "
                                  "posting order); use tag=0, or the native/verbs transport")
        for buf in (desc.send, desc.recv):
            if buf is not None and buf.device_index != self._device:
                raise InvalidArgument(f"buffer is on cuda:{buf.device_index}, but this communicator "
                                      f"drives cuda:{self._device}; move it there (one GPU per rank)")
        _cuda_check(_cudart.cudaSetDevice(self._device), "cudaSetDevice")
        # The internal stream starts where the caller's current stream is now (the inputs'
        # producers are before this point), as torch's NCCL backend does.
        _cuda_check(_cudart.cudaEventRecord(self._ready, gpu.current_stream(self._device)), "cudaEventRecord")
        _cuda_check(_cudart.cudaStreamWaitEvent(self._stream, self._ready, 0), "cudaStreamWaitEvent")
        keep, premul_ops = [desc.send, desc.recv], []
        self._record_stream(keep)
        try:
            self._nccl_call(lambda: self._enqueue(desc, self._stream, premul_ops), None, None)
            self._settle_call(desc.kind.label)
        finally:
            for op in premul_ops if not self._aborted else ():
                _nccl.red_op_destroy(op, self._comm)  # allowed once the call using it returned
        event = _cuda_check(_cudart.cudaEventCreateWithFlags(_cudart.cudaEventDisableTiming),
                            "cudaEventCreate")
        _cuda_check(_cudart.cudaEventRecord(event, self._stream), "cudaEventRecord")
        return NcclRequest(self, event, keep)

    def _settle_call(self, op: str) -> None:
        """A non-blocking communicator may return before a call is enqueued: wait for it."""
        try:
            self._settle(self._comm, self._timeout, None, op)
        except CommError:
            self._aborted = True   # _settle aborted it
            raise

    def _record_stream(self, bufs) -> None:
        """Tell torch's caching allocator that the internal stream uses these tensors, so their
        memory is not handed out again before the NCCL call has finished with it."""
        torch = sys.modules.get("torch")
        if torch is None:
            return
        for buf in bufs:
            if buf is not None and isinstance(buf.obj, torch.Tensor):
                if self._torch_stream is None:   # torch loaded after this communicator: the
                    # stream is ours, and now outlives close() (see __init__)
                    self._torch_stream = torch.cuda.ExternalStream(self._stream, device=f"cuda:{self._device}")
                buf.obj.record_stream(self._torch_stream)

    def _enqueue(self, d: OpDesc, stream: int, premul_ops: list) -> None:
        c, k = self._comm, d.kind
        if k is OpKind.ALL_REDUCE:
            dt, op = self._reduction(d, premul_ops)
            _nccl.all_reduce(d.send.ptr, d.recv.ptr, d.count, dt, op, c, stream)
        elif k is OpKind.REDUCE_SCATTER:
            dt, op = self._reduction(d, premul_ops)
            _nccl.reduce_scatter(d.send.ptr, d.recv.ptr, d.count, dt, op, c, stream)
        elif k is OpKind.REDUCE:
            dt, op = self._reduction(d, premul_ops)
            recv = d.recv.ptr if d.recv is not None else 0   # only read on the root
            _nccl.reduce(d.send.ptr, recv, d.count, dt, op, d.root, c, stream)
        elif k is OpKind.ALL_GATHER:
            _nccl.all_gather(d.send.ptr, d.recv.ptr, d.send.nbytes, NCCL_UINT8, c, stream)
        elif k is OpKind.BROADCAST:
            _nccl.broadcast(d.send.ptr, d.recv.ptr, d.send.nbytes, NCCL_UINT8, d.root, c, stream)
        elif k is OpKind.BARRIER:
            _nccl.all_reduce(self._scratch, self._scratch, 1, NCCL_FLOAT32, NCCL_SUM, c, stream)
        elif k is OpKind.SEND:
            _nccl.send(d.send.ptr, d.send.nbytes, NCCL_UINT8, d.peer, c, stream)
        elif k is OpKind.RECV:
            _nccl.recv(d.recv.ptr, d.recv.nbytes, NCCL_UINT8, d.peer, c, stream)
        else:  # GATHER, SCATTER, ALL_TO_ALL: grouped point-to-point, every NCCL version has it
            self._grouped(d, stream)

    def _reduction(self, d: OpDesc, premul_ops: list) -> tuple[int, int]:
        try:
            dt, op = reduction_types(d.dtype, d.op)
        except InvalidArgument as e:
            raise InvalidArgument(e.cause, rank=self.rank, op=d.kind.label) from None
        if op is None:
            scalar = premul_scalar(d.dtype, d.scale)
            op = _nccl.red_op_create_pre_mul_sum(scalar.ctypes.data, dt, _SCALAR_HOST_IMMEDIATE, self._comm)
            premul_ops.append(op)  # host-immediate: NCCL copied the factor during create
        return dt, op

    def _grouped(self, d: OpDesc, stream: int) -> None:
        """gather / scatter / all_to_all(v) as one group of byte sends and receives (self included)."""
        n, item = self.size, d.dtype.itemsize
        if d.kind is OpKind.ALL_TO_ALL:
            sends, recvs = self._blocks(d.send, d.send_counts), self._blocks(d.recv, d.recv_counts)
        elif d.kind is OpKind.GATHER:
            sends = {d.root: (d.send.ptr, d.send.nbytes)}
            recvs = self._blocks(d.recv, (d.count,) * n) if self.rank == d.root else {}
        else:  # SCATTER
            sends = self._blocks(d.send, (d.count,) * n) if self.rank == d.root else {}
            recvs = {d.root: (d.recv.ptr, d.count * item)}
        _nccl.group_start()
        try:
            for peer, (ptr, nbytes) in sends.items():
                if nbytes:  # both sides skip empty blocks: send_counts[j] at i == recv_counts[i] at j
                    _nccl.send(ptr, nbytes, NCCL_UINT8, peer, self._comm, stream)
            for peer, (ptr, nbytes) in recvs.items():
                if nbytes:
                    _nccl.recv(ptr, nbytes, NCCL_UINT8, peer, self._comm, stream)
        finally:
            _nccl.group_end()

    @staticmethod
    def _blocks(buf: Buffer, counts) -> dict[int, tuple[int, int]]:
        """Per-rank (pointer, bytes) of a buffer packed in rank order."""
        out, offset = {}, 0
        for peer, count in enumerate(counts):
            out[peer] = (buf.ptr + offset * buf.dtype.itemsize, count * buf.dtype.itemsize)
            offset += count
        return out

    # ---- groups and lifetime ---------------------------------------------------------------
    def split(self, color: int, key: int, ctx: BootstrapContext | None) -> "NcclTransport | None":
        """ncclCommSplit: reuses the parent's connections. It is collective over the parent, so
        every parent rank must call it; a rank that joins no group passes ctx=None (NOCOLOR).
        A parent all-gather of the colours first turns a missing rank into CommTimeout, not a
        hang inside NCCL; the child (non-blocking like its parent) is polled under the timeout."""
        self._check()
        self._splits += 1
        self._ctx.store.all_gather(f"nccl/split{self._splits}", struct.pack("!q", color))
        joined = ctx is not None and color >= 0
        _cuda_check(_cudart.cudaSetDevice(self._device), "cudaSetDevice")
        comm = self._nccl_call(lambda: _nccl.comm_split(self._comm, color if joined else _NOCOLOR, key, 0),
                               self.rank, "split")
        self._settle_call("split")
        if not joined:
            return None
        self._settle(comm, self._timeout, self.rank, "split")
        return type(self)(ctx, comm, self._device)

    def abort(self) -> None:
        """ncclCommAbort: kills the kernels still running on this communicator; any thread."""
        if self._aborted or self._closed:
            return
        self._aborted = True
        _nccl.comm_abort(self._comm)
        self._free()

    def _free(self) -> None:
        _cudart.cudaFree(self._scratch)
        _cudart.cudaEventDestroy(self._ready)
        if self._torch_stream is None:   # never shown to torch's allocator
            _cudart.cudaStreamDestroy(self._stream)

    def close(self) -> None:
        if self._closed:
            return
        if not self._aborted:
            # finalize flushes outstanding work (non-blocking: polled, bounded by the timeout);
            # after a failure only abort is safe (no peers).
            try:
                _nccl.comm_finalize(self._comm)
                _poll(lambda: _nccl.comm_get_async_error(self._comm), self._timeout, "finalize")
            except (CommTimeout, _nccl.NCCLError):
                self.abort()
            else:
                _nccl.comm_destroy(self._comm)
                self._free()
        self._closed = True
