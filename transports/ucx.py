"""The UCX transport, through ucxx's synchronous API (ucxx._lib.libucxx).

UCX gives tagged point-to-point messaging over whatever the machine has (shared memory and
TCP here, RDMA where the fabric has it; UCX_TLS chooses). The collectives over it are
comm.algorithms' schedules: this module only implements their P2P interface.

- One UCX worker per communicator, progressed by ucxx's own progress thread in blocking
  (epoll) mode, so idle ranks leave the CPU alone; an endpoint to every peer, made from the
  worker addresses exchanged through the bootstrap store.
- A 64-bit UCX tag is (source rank << 32) | 32-bit tag: receives name their source exactly,
  and collective tags (bit 31 set) cannot meet user tags.
- Collectives run on a transports.base.ProgressThread in posting order, so async_op=True
  returns at once; a blocking call on an idle communicator runs on the caller's thread.
  User send/recv go straight to UCX: a pending irecv must not hold up later collectives.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from comm import config
from comm.algorithms import run as run_collective
from comm.errors import Aborted, CommError, CommTimeout, Mismatch, PeerFailure, TransportUnavailable

from .base import BootstrapContext, CompletedRequest, OpDesc, OpKind, ProgressThread, Request, Transport, register

try:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
    _IMPORT_ERROR = None
except (ImportError, OSError) as e:  # available() reports it
    ucx_api = Array = None
    _IMPORT_ERROR = f"ucxx cannot be imported ({e}); pip install ucxx-cu12"
    if "mpi4py.MPI" in sys.modules:  # Open MPI's wheel bundles an older UCX under the same sonames
        _IMPORT_ERROR += "; MPI was loaded first: create the ucx transport before importing mpi4py.MPI"

_PEER_LOST = ("ConnectionReset", "EndpointTimeout", "Unreachable", "LinkFailure", "EndpointFailure",
              "NotConnected", "Rejected")


def _error(e: Exception, peer: int | None) -> CommError:
    """A ucxx exception as the library's error, by its class name (ucxx's classes are made at
    run time)."""
    kind = type(e).__name__
    if "Truncated" in kind:
        return Mismatch(f"a message from rank {peer} is larger than the receive posted for it "
                        "(ranks called the operation with different sizes)")
    if any(k in kind for k in _PEER_LOST):
        return PeerFailure(f"lost rank {peer}: {e}", peer=peer)
    if "Cancel" in kind:
        return Aborted(f"cancelled: {e}")
    return CommError(f"UCX error ({kind}): {e}")


class _Message:
    """A posted UCX request and the peer it talks to (for error messages)."""

    __slots__ = ("req", "peer", "arr")

    def __init__(self, req, peer: int, arr: np.ndarray):
        self.req, self.peer, self.arr = req, peer, arr  # arr: kept alive until completion


class UCXRequest(Request):
    """A user send or receive posted straight to UCX."""

    __slots__ = ("_transport", "_msg", "_desc")

    def __init__(self, transport: "UCXTransport", msg: _Message, desc: OpDesc):
        self._transport, self._msg, self._desc = transport, msg, desc

    def test(self) -> bool:
        return self._transport._done(self._msg)

    def wait(self, timeout: float | None = None) -> None:
        self._transport.wait([self._msg], timeout)


class UCXTransport(Transport):
    name = "ucx"
    devices = frozenset({"cpu"})

    def __init__(self, ctx: BootstrapContext):
        self.rank, self.size, self.timeout = ctx.rank, ctx.size, ctx.timeout
        self._aborted = False
        self._closed = False
        self._algo = config.get("COMM_ALGO")
        self._chunk_bytes = config.get("COMM_CHUNK_BYTES")
        self._context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._context)
        # Blocking (epoll) progress, not polling: 8 ranks may share 2 cores.
        self._worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        addresses = ctx.store.all_gather("ucx-address", self._worker.address.tobytes())
        self._eps = {peer: ucx_api.UCXEndpoint.create_from_worker_address(
                         self._worker, ucx_api.UCXAddress.create_from_buffer(addr), True)
                     for peer, addr in enumerate(addresses) if peer != self.rank}
        self._thread = ProgressThread(f"comm-ucx-{ctx.group_name}-{ctx.rank}")

    @classmethod
    def available(cls) -> str | None:
        return _IMPORT_ERROR

    @classmethod
    def create(cls, ctx: BootstrapContext) -> "UCXTransport":
        if ucx_api is None:
            raise TransportUnavailable(_IMPORT_ERROR, rank=ctx.rank, op="init")
        try:
            return cls(ctx)
        except Exception as e:
            if isinstance(e, CommError):
                raise
            raise _error(e, None).locate(ctx.rank, "init") from None

    # ---- comm.algorithms.p2p.P2P -------------------------------------------------------------
    def isend(self, peer: int, tag: int, arr: np.ndarray) -> _Message:
        return _Message(self._eps[peer].tag_send(Array(arr), ucx_api.UCXXTag((self.rank << 32) | tag)), peer, arr)

    def irecv(self, peer: int, tag: int, arr: np.ndarray) -> _Message:
        req = self._worker.tag_recv(Array(arr), ucx_api.UCXXTag((peer << 32) | tag), ucx_api.UCXXTagMaskFull)
        return _Message(req, peer, arr)

    def _done(self, msg: _Message) -> bool:
        if self._aborted:
            raise Aborted("the communicator was aborted")
        if not msg.req.completed:
            return False
        try:
            msg.req.check_error()
        except Exception as e:  # ucxx raises its own run-time made classes
            raise _error(e, msg.peer) from None
        return True

    def wait(self, handles, timeout: float | None) -> None:
        # Spin briefly, then sleep with backoff up to 1 ms: UCX's progress thread completes
        # the requests, this thread only watches (and must leave the CPU to it).
        start = time.monotonic()
        spin_until, pause = start + 50e-6, 10e-6
        pending = list(handles)
        while pending:
            pending = [m for m in pending if not self._done(m)]
            if not pending:
                return
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                peers = sorted({m.peer for m in pending})
                raise CommTimeout(f"no progress with rank(s) {peers} within {timeout:g} s (slow, hung, "
                                  "or calling a different operation)")
            if now > spin_until:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)

    # ---- Transport -----------------------------------------------------------------------------
    def post(self, desc: OpDesc, blocking: bool) -> Request:
        if self._aborted:
            raise Aborted("the communicator was aborted")
        if desc.kind is OpKind.SEND:
            return UCXRequest(self, self.isend(desc.peer, desc.tag, desc.send.numpy()), desc)
        if desc.kind is OpKind.RECV:
            return UCXRequest(self, self.irecv(desc.peer, desc.tag, desc.recv.numpy()), desc)
        if blocking and self._thread.idle:
            self._collective(desc)
            return CompletedRequest()
        return self._thread.submit(self._collective, desc)

    def _collective(self, desc: OpDesc) -> None:
        run_collective(desc, self, timeout=self.timeout, chunk_bytes=self._chunk_bytes, algo=self._algo)

    def abort(self) -> None:
        # Waits notice within a millisecond. UCX requests are not cancelled from here: the
        # worker belongs to ucxx's progress thread, and the communicator is finished anyway.
        self._aborted = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.stop()
        self._worker.stop_progress_thread()
        self._eps.clear()


register(UCXTransport)
