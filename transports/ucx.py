"""The UCX transport, through ucxx's synchronous API (ucxx._lib.libucxx).

UCX gives tagged point-to-point messaging over whatever the machine has (shared memory and
TCP here, RDMA where the fabric has it; UCX_TLS chooses). The collectives over it are
comm.algorithms' schedules: this module only implements their P2P interface.

- One UCX worker per communicator and an endpoint to every peer, made from the worker
  addresses exchanged through the bootstrap store. Peers on the same host get endpoints
  without UCX error handling, which would rule out UCX's shared-memory transports (TCP only,
  about 10x slower here).
- The worker is progressed by whichever thread waits or tests (MPI's progress rule): ucxx's
  progress thread, in blocking (epoll) mode, added a millisecond per protocol step, and in
  polling mode it takes a core from ranks that share two. So an isend nobody waits on
  advances when this rank next waits on anything.
- A 64-bit UCX tag is (source rank << 32) | 32-bit tag: receives name their source exactly,
  and collective tags (bit 31 set) cannot meet user tags.
- Collectives run through a transports.base.CollectiveQueue in posting order, so async_op=True
  returns at once; a blocking call on an idle communicator runs on the caller's thread.
  User send/recv go straight to UCX: a pending irecv must not hold up later collectives.
"""
from __future__ import annotations

import struct
import sys

import numpy as np

from comm import config
from comm.errors import (
    Aborted,
    CommError,
    CommTimeout,
    Mismatch,
    PeerFailure,
    TransportUnavailable,
)

from .base import (
    BootstrapContext,
    OpDesc,
    OpKind,
    CollectiveQueue,
    Request,
    Transport,
    poll_until,
    register,
)

try:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
    _IMPORT_ERROR = None
except (ImportError, OSError) as e:  # available() reports it
    ucx_api = Array = None
    _IMPORT_ERROR = f"ucxx cannot be imported ({e}); pip install ucxx-cu12"
    if "mpi4py.MPI" in sys.modules:  # Open MPI's wheel bundles an older UCX under the same sonames
        _IMPORT_ERROR += ("; mpi4py.MPI was imported first with Open MPI's own UCX: import it "
                          "through transports.mpi.load_mpi()")

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

    __slots__ = ("arr", "peer", "req")

    def __init__(self, req, peer: int, arr: np.ndarray):
        self.req, self.peer, self.arr = req, peer, arr  # arr: kept alive until completion


class UCXRequest(Request):
    """A user send or receive posted straight to UCX."""

    __slots__ = ("_desc", "_msg", "_transport")

    def __init__(self, transport: UCXTransport, msg: _Message, desc: OpDesc):
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
        self._context = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._context)
        host = ctx.host_id.encode()
        entries = ctx.store.all_gather("ucx-address", struct.pack("!I", len(host)) + host
                                       + self._worker.address.tobytes())
        self._eps = {}
        for peer, entry in enumerate(entries):
            if peer == self.rank:
                continue
            (n,) = struct.unpack_from("!I", entry)
            # UCX's error handling (peer failure reports) rules out its shared-memory
            # transports, so it is on only across hosts; a dead peer on this host still
            # surfaces, as the op's timeout.
            remote_host = entry[4:4 + n]
            address = ucx_api.UCXAddress.create_from_buffer(entry[4 + n:])
            self._eps[peer] = ucx_api.UCXEndpoint.create_from_worker_address(
                self._worker, address, remote_host != host)
        self._collectives = CollectiveQueue(self, f"comm-ucx-{ctx.group_name}-{ctx.rank}",
                                            timeout=ctx.timeout, chunk_bytes=config.get("COMM_CHUNK_BYTES"),
                                            algo=config.get("COMM_ALGO"))

    @classmethod
    def available(cls) -> str | None:
        return _IMPORT_ERROR

    @classmethod
    def create(cls, ctx: BootstrapContext) -> UCXTransport:
        if ucx_api is None:
            raise TransportUnavailable(_IMPORT_ERROR, rank=ctx.rank, op="init")
        try:
            return cls(ctx)
        except CommError:
            raise
        except Exception as e:  # noqa: BLE001  (ucxx raises classes it makes at run time)
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
            self._worker.progress()
            if not msg.req.completed:
                return False
        try:
            msg.req.check_error()
        except Exception as e:  # noqa: BLE001  (ucxx raises classes it makes at run time)
            raise _error(e, msg.peer) from None
        return True

    def wait(self, handles, timeout: float | None) -> None:
        pending = list(handles)

        def done() -> bool:  # progresses the worker (in _done) on every poll
            pending[:] = [m for m in pending if not self._done(m)]
            return not pending

        poll_until(done, timeout, lambda: CommTimeout(
            f"no progress with rank(s) {sorted({m.peer for m in pending})} within {timeout:g} s "
            "(slow, hung, or calling a different operation)"))

    # ---- Transport -----------------------------------------------------------------------------
    def post(self, desc: OpDesc, blocking: bool) -> Request:
        if self._aborted:
            raise Aborted("the communicator was aborted")
        if desc.kind is OpKind.SEND:
            return UCXRequest(self, self.isend(desc.peer, desc.tag, desc.send.numpy()), desc)
        if desc.kind is OpKind.RECV:
            return UCXRequest(self, self.irecv(desc.peer, desc.tag, desc.recv.numpy()), desc)
        return self._collectives.post(desc, blocking)

    def abort(self) -> None:
        # Waits notice within a millisecond. UCX requests are not cancelled from here: the
        # worker belongs to ucxx's progress thread, and the communicator is finished anyway.
        self._aborted = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._collectives.stop()
        self._eps.clear()


register(UCXTransport)
