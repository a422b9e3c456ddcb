"""VerbsTransport: point-to-point over the engine, collectives from comm.algorithms.

send/recv go straight to the engine, zero copy, from host or GPU memory (GPUDirect RDMA).
Collectives run on the transport's progress thread through comm.algorithms.run, whose
reductions are numpy code: CUDA buffers of a collective are therefore staged through pinned
host memory by comm.staging (copied down, reduced on the CPU, copied back). Only send/recv
are GPUDirect.
"""
from __future__ import annotations

from comm import config
from comm.buffers import Buffer
from comm.errors import CommError, TransportUnavailable
from comm.staging import Stager

from ..base import (BootstrapContext, CollectiveQueue, OpDesc, OpKind, Request, Transport,
                    register)
from . import device as dev
from .engine import Engine, Message
from .wire import WireError


class MessageRequest(Request):
    __slots__ = ("_engine", "_msg")

    def __init__(self, engine: Engine, msg: Message):
        self._engine, self._msg = engine, msg

    def test(self) -> bool:
        return self._engine.test(self._msg)

    def wait(self, timeout: float | None = None) -> None:
        self._engine.wait([self._msg], timeout)


def _port() -> dev.Port:
    return dev.find_port(config.get("COMM_VERBS_DEVICE"), config.get("COMM_VERBS_GID_INDEX"))


@register
class VerbsTransport(Transport):
    name = "verbs"
    devices = frozenset({"cpu", "cuda"})

    @classmethod
    def available(cls) -> str | None:
        try:
            _port()
        except TransportUnavailable as e:
            return e.cause
        return None

    def __init__(self, ctx: BootstrapContext, engine: Engine):
        self.rank, self.size = ctx.rank, ctx.size
        self._engine = engine
        self._collectives = _Collectives(engine, f"comm-verbs-{ctx.group_name}",
                                               timeout=ctx.timeout, chunk_bytes=config.get("COMM_CHUNK_BYTES"),
                                               algo=config.get("COMM_ALGO"))
        self._stager = None
        self._closed = False

    @classmethod
    def create(cls, ctx: BootstrapContext) -> "VerbsTransport":
        try:
            port = _port()
        except TransportUnavailable as e:
            raise e.locate(ctx.rank, "init") from None
        try:
            engine = Engine(ctx.rank, ctx.size, port, ctx.timeout, config.get("COMM_VERBS_HOP_LIMIT"))
        except dev.pv.pyverbs_error.PyverbsError as e:
            raise CommError(f"cannot open {port.device}:{port.port}: {e}", rank=ctx.rank, op="init") from None
        try:
            records = ctx.store.all_gather("verbs/addr", engine.address())
            engine.connect(records)
            ctx.store.barrier("verbs/ready")   # every QP is ready to receive before anyone writes
        except WireError as e:
            engine.close()
            raise CommError(f"bad verbs address record: {e}", rank=ctx.rank, op="init") from None
        except BaseException:
            engine.close()
            raise
        return cls(ctx, engine)

    def post(self, desc: OpDesc, blocking: bool) -> Request:
        if desc.kind is OpKind.SEND:
            return MessageRequest(self._engine, self._message(desc.send, desc, send=True))
        if desc.kind is OpKind.RECV:
            return MessageRequest(self._engine, self._message(desc.recv, desc, send=False))
        if Stager.involves(desc):   # the reductions run on the CPU: stage CUDA buffers
            if self._stager is None:
                self._stager = Stager(self._collectives.post, "verbs collectives")
            return self._stager.post(desc, blocking)
        return self._collectives.post(desc, blocking)

    def _message(self, buf: Buffer, desc: OpDesc, send: bool) -> Message:
        if buf.device == "cuda" and send:
            dev.cuda_bind(buf.device_index)
            dev.cuda_sync()
        post = self._engine.send_range if send else self._engine.recv_range
        return post(desc.peer, desc.tag, buf.ptr, buf.nbytes, buf.device, buf.device_index, buf.obj)

    def abort(self) -> None:
        self._engine.abort()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine.abort()      # a collective still queued fails instead of running
        self._collectives.stop()
        self._engine.close()
        if self._stager is not None:
            self._stager.close()


class _Collectives(CollectiveQueue):
    """Collectives over the engine. Host copies of CUDA buffers (comm.staging's pinned blocks)
    own no array, so their registrations are dropped after each collective."""

    def _run(self, desc: OpDesc, seq: int) -> None:
        try:
            super()._run(desc, seq)
        finally:
            self._p2p.forget_unowned()
