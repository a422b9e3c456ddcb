"""The transport protocol's types: the operation descriptor and bootstrap context the
communicator hands a transport, and the Request it gets back."""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field

from .buffers import Buffer
from .types import DType, ReduceOp


class OpKind(enum.IntEnum):
    """Operation kinds. Values are wire codes shared with the native engine: never renumber."""

    ALL_REDUCE = 0
    REDUCE_SCATTER = 1
    ALL_GATHER = 2
    BROADCAST = 3
    REDUCE = 4
    GATHER = 5
    SCATTER = 6
    ALL_TO_ALL = 7
    SEND = 8
    RECV = 9
    BARRIER = 10
    ALL_GATHER_V = 11
    REDUCE_SCATTER_V = 12

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class OpDesc:
    """One operation. Counts are in elements; see each kind's buffer convention below.

    ALL_REDUCE     send[count] -> recv[count]            (in place when send.ptr == recv.ptr)
    REDUCE_SCATTER send[n*count] -> recv[count]
    ALL_GATHER     send[count] -> recv[n*count]          (in place: send is recv's slot `rank`)
    BROADCAST      send is recv, [count]; root's data goes out
    REDUCE         send[count] -> recv[count] on root (recv None elsewhere)
    GATHER         send[count] -> recv[n*count] on root (recv None elsewhere)
    SCATTER        send[n*count] on root (None elsewhere) -> recv[count]
    ALL_TO_ALL     send[sum(send_counts)] -> recv[sum(recv_counts)], packed in rank order
    ALL_GATHER_V   send[recv_counts[rank]] -> recv[sum(recv_counts)], blocks in rank order
                   (in place: send is recv's block `rank`); count is recv_counts[rank]
    REDUCE_SCATTER_V send[sum(recv_counts)] -> recv[recv_counts[rank]]; count is recv_counts[rank]
                   (the counts are MPI's recvcounts in both: the size of each rank's block)
    SEND / RECV    send or recv [count] with `peer` and `tag`; same (peer, tag) matches in order
    BARRIER        no buffers
    """

    kind: OpKind
    send: Buffer | None = None
    recv: Buffer | None = None
    dtype: DType = DType.UINT8
    count: int = 0
    op: ReduceOp = ReduceOp.SUM
    scale: float = 1.0
    root: int = 0
    peer: int = -1
    tag: int = 0
    send_counts: tuple[int, ...] | None = None
    recv_counts: tuple[int, ...] | None = None
    seq: int = 0
    # A float32 all_reduce, reduce_scatter, all_gather or v form compressed between hosts by the
    # transport itself (comm.compress sets it only where the transport says it can:
    # Transport.compressed_wire): "bf16" or "fp8" with wire_block elements per scale. None:
    # the exact path.
    wire: str | None = None
    wire_block: int = 0


@dataclass
class BootstrapContext:
    """What a transport needs to connect one group: who it is, and a store scoped to the group."""

    rank: int
    size: int
    store: object  # comm.bootstrap.store.Store
    timeout: float
    host_id: str
    secret: bytes | None = None
    bind_addr: str | None = None
    group_name: str = "world"
    options: dict = field(default_factory=dict)
    host_ids: tuple[str, ...] = ()   # every rank's host id, by rank (comm.bootstrap.topology)


class Request(abc.ABC):
    """A posted operation. wait() raises a CommError subclass if the operation failed."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None: ...

    @abc.abstractmethod
    def test(self) -> bool: ...


class CompletedRequest(Request):
    """A request that finished when it was posted (blocking path). Use the DONE instance:
    the communicator skips waiting on it."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def test(self) -> bool:
        return True


DONE = CompletedRequest()

# What a transport's lean path (run_array, see transports/base.py) did with a call.
LEAN_SKIPPED, LEAN_BUSY = 0, 2


def held_buffers(desc: OpDesc):
    """(array, buffer, written, name) for each buffer of desc: what a persistent operation's
    start must re-check (comm.persistent, and the engine's prepared ops). The array is the object that owns the memory (for DLPack imports, numpy's view of it)."""
    bufs = []
    if desc.kind is OpKind.BROADCAST:
        bufs.append((desc.recv, True, "buffer"))
    else:
        if desc.send is not None:
            bufs.append((desc.send, False, "input"))
        if desc.recv is not None and desc.recv is not desc.send:
            bufs.append((desc.recv, True, "output"))
        elif desc.recv is not None:  # in place: the input is written too
            bufs[-1] = (desc.recv, True, "input")
    return [(b.obj[0] if type(b.obj) is tuple else b.obj, b, written, what)
            for b, written, what in bufs]
