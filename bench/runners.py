"""Runners: how one library is driven. One interface, one small class per library.

A runner is set up once per transport (`setup`), then the benchmarks call its operation
methods on buffers it has wrapped (`wrap`), and `teardown` releases it. Operation methods are
the hot path: they translate straight into one library call, nothing else.

    CommRunner(name)   this library's communicator on transport `name` (native, mpi, ucx, ...)
    TorchRunner(name)  torch.distributed on a backend: gloo (anchor), or torch-comm, this
                       library's backend "comm" (its CPU transport is COMM_TRANSPORT): what
                       torch's layer costs over the communicator's own calls
    MpiRawRunner       anchor: plain mpi4py calls on COMM_WORLD (needs an MPI launcher)
    P2PRunner          anchor for the one-sided benchmarks: this library's send / recv (on
                       COMM_TRANSPORT) doing the same transfers two-sided ("comm-p2p")

The one-sided benchmarks' operations (open_window, put_flush, ...) are in bench/windows.py,
one mixin per library.

Adding a runner: subclass Runner, fill in `unavailable`, `setup`, `teardown`, `supports` and
the operations, and add it to `make_runner`.
"""
from __future__ import annotations

import datetime
import functools
import importlib.util
import warnings

import numpy as np

from comm.core.types import DType, ReduceOp

from .windows import ONE_SIDED, CommWindows, MemcpyWindows, MpiWindows, P2PWindows

ANCHORS = ("gloo", "mpi-raw", "comm-p2p", "memcpy")
TORCH_BACKENDS = {"torch-comm": "comm", "gloo": "gloo"}   # runner name -> torch.distributed backend
NAMES = ("torch-comm",) + ANCHORS   # the runners that are not one of this library's transports
MPI_LAUNCHERS = ("openmpi", "hydra", "slurm")


class Runner:
    """The interface every benchmark uses. Buffers are numpy storage arrays passed through wrap()."""

    name: str = "?"
    kind: str = "comm"            # "comm" (this library), "torch" (it, through torch.distributed) or "anchor"
    rank: int = 0
    size: int = 1

    def unavailable(self, launcher: str) -> str | None:
        """None when this runner can run here under `launcher`, else a one-line reason."""
        return None

    def setup(self, rank: int, size: int, addr: str, port: int, timeout: float | None) -> None:
        self.rank, self.size = rank, size

    def teardown(self) -> None: ...

    def supports(self, bench: str, dtype: DType, op: ReduceOp | None, in_place: bool) -> str | None:
        """None when the library has this operation in this form, else why not (one line)."""
        return None

    def wrap(self, arr: np.ndarray, dtype: DType):
        """A numpy storage array -> what the library's calls take (no copy)."""
        return arr

    def bind(self, op: str, *args):
        """The zero-argument call a benchmark times: operation `op` on these arguments.
        functools.partial is C, so the timed call has no Python frame of the benchmark's own."""
        return functools.partial(getattr(self, op), *args)

    # ---- operations (hot path). in_place: send is recv (all_gather: send is recv's slot) ----
    def all_reduce(self, send, recv, op: ReduceOp, scale: float | None, in_place: bool): ...
    def reduce_scatter(self, send, recv, op: ReduceOp, scale: float | None): ...
    def all_gather(self, send, recv, in_place: bool): ...
    def broadcast(self, buf, root: int): ...
    def reduce(self, send, recv, root: int, op: ReduceOp, scale: float | None, in_place: bool): ...
    def all_to_all(self, send, recv, send_counts, recv_counts): ...
    def all_gather_v(self, send, recv, counts, in_place: bool): ...
    def reduce_scatter_v(self, send, recv, counts, op: ReduceOp, scale: float | None): ...
    def sendrecv(self, send, recv, dst: int, src: int): ...
    def barrier(self): ...


def _torch_view(arr: np.ndarray, dtype: DType):
    import torch
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype is DType.BFLOAT16 else t


class CommRunner(CommWindows, Runner):
    """This library: comm.init(transport=name) and the Communicator's calls."""

    kind = "comm"

    def __init__(self, name: str):
        self.name = name
        self.world = None

    def unavailable(self, launcher):
        from transports import base
        reason = base.unavailable_reason(self.name)
        if reason is None and "cpu" not in base.get(self.name).devices:
            return "takes device buffers only; the bench allocates CPU buffers"
        return reason

    def setup(self, rank, size, addr, port, timeout):
        import comm
        super().setup(rank, size, addr, port, timeout)
        self.world = comm.init(rank=rank, world_size=size, master_addr=addr, master_port=port,
                               transport=self.name, timeout=timeout)

    def teardown(self):
        if self.world is not None:
            self.world.close()
            self.world = None

    def supports(self, bench, dtype, op, in_place):
        if dtype is DType.BFLOAT16 and importlib.util.find_spec("torch") is None:
            return "bfloat16 arrays come from torch (numpy has none): pip install torch"
        if bench in ("reduce_scatter", "reduce_scatter_v") and in_place:
            return "no in-place reduce_scatter in the API"
        if bench in ("all_to_all", "all_to_all_v", "sendrecv") and in_place:
            return "out-of-place only"
        if bench in ("all_gather_v", "reduce_scatter_v"):
            from comm.core.ops import OpKind
            from transports import base
            if OpKind[bench.upper()] not in base.get(self.name).kinds:
                return f"transport {self.name} has no {bench}"
        if bench in ONE_SIDED:
            from transports import base
            if base.get(self.name).window is base.Transport.window:
                return f"transport {self.name} has no one-sided windows"
        return None

    def wrap(self, arr, dtype):
        return _torch_view(arr, dtype) if dtype is DType.BFLOAT16 else arr

    def all_reduce(self, send, recv, op, scale, in_place):
        self.world.all_reduce(send, op, out=None if in_place else recv, scale=scale)

    def reduce_scatter(self, send, recv, op, scale):
        self.world.reduce_scatter(recv, send, op, scale=scale)

    def all_gather(self, send, recv, in_place):
        self.world.all_gather(recv, send)

    def broadcast(self, buf, root):
        self.world.broadcast(buf, root)

    def reduce(self, send, recv, root, op, scale, in_place):
        self.world.reduce(send, root, op, out=None if in_place else recv, scale=scale)

    def all_to_all(self, send, recv, send_counts, recv_counts):
        self.world.all_to_all(recv, send, recv_counts, send_counts)

    def all_gather_v(self, send, recv, counts, in_place):
        self.world.all_gather_v(recv, send, counts)

    def reduce_scatter_v(self, send, recv, counts, op, scale):
        self.world.reduce_scatter_v(recv, send, counts, op, scale=scale)

    def sendrecv(self, send, recv, dst, src):
        s = self.world.isend(send, dst)   # send first: a library that runs p2p in posting
        r = self.world.irecv(recv, src)   # order would deadlock on recv-first from every rank
        s.wait()
        r.wait()

    def barrier(self):
        self.world.barrier()


class AsyncCommRunner(CommRunner):
    """--async: each operation is posted with async_op=True and waited for at once (what DDP's
    buckets and a decode step's early all-reduce cost when there is nothing to overlap)."""

    def all_reduce(self, send, recv, op, scale, in_place):
        self.world.all_reduce(send, op, out=None if in_place else recv, scale=scale, async_op=True).wait()

    def reduce_scatter(self, send, recv, op, scale):
        self.world.reduce_scatter(recv, send, op, scale=scale, async_op=True).wait()

    def all_gather(self, send, recv, in_place):
        self.world.all_gather(recv, send, async_op=True).wait()

    def broadcast(self, buf, root):
        self.world.broadcast(buf, root, async_op=True).wait()

    def reduce(self, send, recv, root, op, scale, in_place):
        self.world.reduce(send, root, op, out=None if in_place else recv, scale=scale, async_op=True).wait()

    def all_to_all(self, send, recv, send_counts, recv_counts):
        self.world.all_to_all(recv, send, recv_counts, send_counts, async_op=True).wait()

    def barrier(self):
        self.world.barrier(async_op=True).wait()


class PersistentCommRunner(CommRunner):
    """This library's persistent collectives (--persistent): binding a case sets its handle up
    (with the case's buffers), and the timed call is the handle itself. Operations without a
    persistent form run as one-shot calls."""

    def __init__(self, name: str, async_op: bool = False):
        super().__init__(name)
        self._h = None
        self._async = async_op   # time h.start(); h.wait() instead of h()

    def bind(self, op: str, *args):
        init = getattr(self, f"_{op}_init", None)
        if init is None:
            return super().bind(op, *args)
        if self._h is not None:   # one case at a time: the previous case is over
            self._h.close()
        h = self._h = init(*args)
        if not self._async:
            return h
        start, wait = h.start, h.wait

        def start_wait():
            start()
            wait()
        return start_wait

    def teardown(self):
        if self._h is not None:
            self._h.close()
            self._h = None
        super().teardown()

    def _all_reduce_init(self, send, recv, op, scale, in_place):
        return self.world.all_reduce_init(send, op, out=None if in_place else recv, scale=scale)

    def _reduce_scatter_init(self, send, recv, op, scale):
        return self.world.reduce_scatter_init(recv, send, op, scale=scale)

    def _all_gather_init(self, send, recv, in_place):
        return self.world.all_gather_init(recv, send)

    def _broadcast_init(self, buf, root):
        return self.world.broadcast_init(buf, root)

    def _all_to_all_init(self, send, recv, send_counts, recv_counts):
        return self.world.all_to_all_init(recv, send, recv_counts, send_counts)

    def _all_gather_v_init(self, send, recv, counts, in_place):
        return self.world.all_gather_v_init(recv, send, counts)

    def _reduce_scatter_v_init(self, send, recv, counts, op, scale):
        return self.world.reduce_scatter_v_init(recv, send, counts, op, scale=scale)


class TorchRunner(Runner):
    """torch.distributed on one backend (in-place collectives only, as torch has them): gloo, the
    anchor, or this library's "comm" (kind "torch")."""

    _OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")   # what gloo reduces with

    def __init__(self, name: str, async_op: bool = False):
        self.name, self.backend = name, TORCH_BACKENDS[name]
        self.kind = "anchor" if name in ANCHORS else "torch"
        self.async_op = async_op   # --async: every call async_op=True, then wait()

    def unavailable(self, launcher):
        try:
            import torch.distributed as dist
        except ImportError as e:
            return f"torch is not installed ({e})"
        if not dist.is_available():
            return "torch has no torch.distributed"
        if self.backend == "gloo":
            return None if dist.is_gloo_available() else "torch has no gloo backend"
        return None

    def setup(self, rank, size, addr, port, timeout):
        import torch.distributed as dist
        if self.backend == "comm":
            import comm.torch  # noqa: F401  registers the backend
        super().setup(rank, size, addr, port, timeout)
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
        self.dist = dist
        wait = datetime.timedelta(seconds=timeout or 300)
        self.group = None   # torch's default group
        if dist.is_initialized():
            # another torch runner is up (the sweep keeps every transport up): a group of our own
            self.store = None
            self.group = dist.new_group(backend=self.backend, timeout=wait)
        else:
            # our own store: a tcp:// init_method would look for torchrun's agent store instead
            self.store = dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=wait)
            dist.init_process_group(self.backend, store=self.store, rank=rank, world_size=size, timeout=wait)
        names = self._OPS if self.backend == "gloo" else self._OPS + ("AVG",)   # comm also averages
        self.ops = {ReduceOp[name]: getattr(dist.ReduceOp, name) for name in names}
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def teardown(self):
        if self.dist.is_initialized():   # a group of our own first: the default's end ends them all
            self.dist.destroy_process_group(self.group)
        self.store = None

    def supports(self, bench, dtype, op, in_place):
        if bench in ONE_SIDED:
            return "torch.distributed has no one-sided operations"
        if dtype is DType.INT16 and self.backend == "gloo":
            return "gloo has no int16"
        if op is not None and op not in self.ops:
            return f"{self.backend} has no {op.name.lower()} in torch.distributed"
        if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dtype.is_floating:
            return "bitwise ops need integers"
        if bench in ("all_reduce", "reduce") and not in_place:
            return "torch.distributed has no out-of-place form"
        if bench in ("reduce_scatter", "all_to_all", "all_to_all_v", "sendrecv") and in_place:
            return "out-of-place only"
        if bench in ("all_gather_v", "reduce_scatter_v"):
            return "torch.distributed has no single-buffer v-collective"
        return None

    def wrap(self, arr, dtype):
        return _torch_view(arr, dtype)

    def all_reduce(self, send, recv, op, scale, in_place):
        _done(self.dist.all_reduce(recv, self.ops[op], group=self.group, async_op=self.async_op))

    def reduce_scatter(self, send, recv, op, scale):
        _done(self._scatter(recv, send, self.ops[op], group=self.group, async_op=self.async_op))

    def all_gather(self, send, recv, in_place):
        _done(self._gather(recv, send, group=self.group, async_op=self.async_op))

    def broadcast(self, buf, root):
        _done(self.dist.broadcast(buf, root, group=self.group, async_op=self.async_op))

    def reduce(self, send, recv, root, op, scale, in_place):
        _done(self.dist.reduce(send, root, self.ops[op], group=self.group, async_op=self.async_op))

    def all_to_all(self, send, recv, send_counts, recv_counts):
        _done(self.dist.all_to_all_single(recv, send, list(recv_counts), list(send_counts),
                                          group=self.group, async_op=self.async_op))

    def sendrecv(self, send, recv, dst, src):
        s = self.dist.isend(send, dst, group=self.group)
        r = self.dist.irecv(recv, src, group=self.group)
        s.wait()
        r.wait()

    def barrier(self):
        _done(self.dist.barrier(group=self.group, async_op=self.async_op))


def _done(work) -> None:
    """Wait for an async call's Work (None from a blocking call)."""
    if work is not None:
        work.wait()


class MpiRawRunner(MpiWindows, Runner):
    """Anchor: the MPI library itself through plain mpi4py buffer calls on a dup of COMM_WORLD."""

    name, kind = "mpi-raw", "anchor"

    def __init__(self, async_op: bool = False):
        self.async_op = async_op

    def bind(self, op, *args):
        fn = getattr(self, f"_async_{op}", None) if self.async_op else None   # sendrecv has none
        return functools.partial(fn or getattr(self, op), *args)
    _REDUCIBLE = (DType.FLOAT32, DType.FLOAT64, DType.INT8, DType.INT16, DType.INT32, DType.INT64,
                  DType.UINT8)

    def unavailable(self, launcher):
        if launcher not in MPI_LAUNCHERS:
            return "needs mpirun (run under mpirun, or self-launch with mpirun on PATH)"
        try:
            import mpi4py  # noqa: F401
        except ImportError as e:
            return f"mpi4py is not installed ({e})"
        return None

    def setup(self, rank, size, addr, port, timeout):
        from transports.mpi import load_mpi   # loads MPI without breaking ucxx (see there)
        MPI = load_mpi()
        super().setup(rank, size, addr, port, timeout)
        if MPI.COMM_WORLD.Get_size() != size or MPI.COMM_WORLD.Get_rank() != rank:
            raise RuntimeError(f"MPI sees rank {MPI.COMM_WORLD.Get_rank()} of {MPI.COMM_WORLD.Get_size()}, "
                               f"the job is rank {rank} of {size}")
        self.MPI = MPI
        self.c = MPI.COMM_WORLD.Dup()
        self.ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD, ReduceOp.MIN: MPI.MIN,
                    ReduceOp.MAX: MPI.MAX, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR,
                    ReduceOp.BXOR: MPI.BXOR}

    def teardown(self):
        self.c.Free()

    # --async: the nonblocking calls (MPI_Iallreduce ...), waited for at once.
    def _async_all_reduce(self, send, recv, op, scale, in_place):
        self.c.Iallreduce(self.MPI.IN_PLACE if in_place else send, recv, self.ops[op]).Wait()

    def _async_reduce_scatter(self, send, recv, op, scale):
        self.c.Ireduce_scatter_block(send, recv, self.ops[op]).Wait()

    def _async_all_gather(self, send, recv, in_place):
        self.c.Iallgather(self.MPI.IN_PLACE if in_place else send, recv).Wait()

    def _async_broadcast(self, buf, root):
        self.c.Ibcast(buf, root).Wait()

    def _async_reduce(self, send, recv, root, op, scale, in_place):
        at_root = self.rank == root
        self.c.Ireduce(self.MPI.IN_PLACE if in_place and at_root else send, recv if at_root else None,
                       self.ops[op], root).Wait()

    def _async_all_to_all(self, send, recv, send_counts, recv_counts):
        self.c.Ialltoallv([send, _displaced(send_counts)], [recv, _displaced(recv_counts)]).Wait()

    def _async_barrier(self):
        self.c.Ibarrier().Wait()

    def supports(self, bench, dtype, op, in_place):
        if op is not None:
            if op not in self.ops:
                return f"MPI has no {op.name.lower()}"
            if dtype not in self._REDUCIBLE:
                return f"MPI has no reduction on {dtype.name.lower()}"
            if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dtype.is_floating:
                return "bitwise ops need integers"
        if bench in ("reduce_scatter", "reduce_scatter_v", "all_to_all", "all_to_all_v", "sendrecv") and in_place:
            return "out-of-place only"
        return None

    def all_reduce(self, send, recv, op, scale, in_place):
        self.c.Allreduce(self.MPI.IN_PLACE if in_place else send, recv, self.ops[op])

    def reduce_scatter(self, send, recv, op, scale):
        self.c.Reduce_scatter_block(send, recv, self.ops[op])

    def all_gather(self, send, recv, in_place):
        self.c.Allgather(self.MPI.IN_PLACE if in_place else send, recv)

    def broadcast(self, buf, root):
        self.c.Bcast(buf, root)

    def reduce(self, send, recv, root, op, scale, in_place):
        at_root = self.rank == root
        self.c.Reduce(self.MPI.IN_PLACE if in_place and at_root else send, recv if at_root else None,
                      self.ops[op], root)

    def all_to_all(self, send, recv, send_counts, recv_counts):
        self.c.Alltoallv([send, _displaced(send_counts)], [recv, _displaced(recv_counts)])

    def all_gather_v(self, send, recv, counts, in_place):
        self.c.Allgatherv(self.MPI.IN_PLACE if in_place else send, [recv, _displaced(counts)])

    def reduce_scatter_v(self, send, recv, counts, op, scale):
        self.c.Reduce_scatter(send, recv, list(counts), self.ops[op])

    def sendrecv(self, send, recv, dst, src):
        self.c.Sendrecv(send, dst, recvbuf=recv, source=src)

    def barrier(self):
        self.c.Barrier()


def _displaced(counts) -> tuple[list[int], list[int]]:
    """MPI's (counts, displacements) for blocks packed in rank order."""
    displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int).tolist()
    return list(counts), displs


class P2PRunner(P2PWindows, CommRunner):
    """Anchor of the one-sided benchmarks: this library's send / recv on COMM_TRANSPORT moving
    the same bytes (a receive posted for each), so a window's gain over two-sided is one ratio."""

    kind = "anchor"

    def __init__(self):
        from comm.core import config
        super().__init__("comm-p2p")
        self.transport = config.get("COMM_TRANSPORT")

    def unavailable(self, launcher):
        from transports import base
        return base.unavailable_reason(self.transport)

    def setup(self, rank, size, addr, port, timeout):
        import comm
        Runner.setup(self, rank, size, addr, port, timeout)
        self.world = comm.init(rank=rank, world_size=size, master_addr=addr, master_port=port,
                               transport=self.transport, timeout=timeout)

    def supports(self, bench, dtype, op, in_place):
        return None if bench in ONE_SIDED else "one-sided benchmarks only (put, get, put_signal, kv)"

    def wrap(self, arr, dtype):
        return arr.view(np.uint8)   # bytes, as a window holds them: a receive must match its send's dtype


class MemcpyRunner(MemcpyWindows, Runner):
    """Anchor of put, get and kv: the same bytes copied within this rank's memory."""

    name, kind = "memcpy", "anchor"

    def supports(self, bench, dtype, op, in_place):
        return None if bench in ("put", "get", "kv") else "a local copy: put, get and kv only"

    def wrap(self, arr, dtype):
        return arr.view(np.uint8)


def make_runner(name: str, persistent: bool = False, async_op: bool = False) -> Runner:
    """async_op (--async): every library's asynchronous form, waited for at once; with
    persistent, this library's h.start(); h.wait()."""
    if name in TORCH_BACKENDS:
        return TorchRunner(name, async_op)
    if name == "mpi-raw":
        return MpiRawRunner(async_op)
    if name == "comm-p2p":
        return P2PRunner()
    if name == "memcpy":
        return MemcpyRunner()
    if persistent:
        return PersistentCommRunner(name, async_op)
    return AsyncCommRunner(name) if async_op else CommRunner(name)
