"""Device check for a GPU machine: tests/device/run.sh (installs, builds, then runs this file).

Sections (each check prints PASS, FAIL or NOT RUN with the reason; a summary ends the run):
1. NCCL at world size 1 through comm.init(transport="nccl") with torch CUDA tensors: every
   collective and dtype, every op NCCL takes (PREMUL_SUM is the one whose result differs from
   the input at one rank), async posting while the GPU is busy, split, abort, the unique id;
   and two ranks on the one GPU, which must be refused on both ranks (not hang).
2. The torch backend "comm": CUDA tensors at world size 1 via NCCL (Work.wait orders the
   current stream without blocking the host, synchronize blocks, futures carry the device);
   at world size 2 via the staged path (both ranks on the one GPU); DDP at 2 ranks staged.
3. comm's API on CUDA tensors over the native transport (staged), two ranks; then one-sided
   windows with CUDA sources and destinations (staged) over native CMA, shm messages and TCP.
4. CUDA-array-interface (CuPy when installed, else a bare interface) and DLPack inputs.
5. The verbs transport: what its discovery sees (ports, GIDs), and a two-rank run (CUDA
   tensors staged as on every host-memory transport) when an RDMA port is active, and a
   window over RDMA WRITE / READ (COMM_WINDOW_RMA=1).

Exit status: 0 when every check that ran passed, 1 on any failure, 2 when nothing could run.
Each section runs in a process of its own (a library's crash fails that section, with the
Python stack faulthandler prints, and the others still run). A watchdog prints every thread's
stack and the summary if the budget (DEVICE_CHECK_BUDGET seconds, default 200) runs out, so a
hang still reports.
"""
from __future__ import annotations

import faulthandler
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [os.path.dirname(TESTS), TESTS]
# rank processes unpickle functions of tests/device/ranks.py: they need this folder too
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])

import comm  # noqa: E402
from comm.core.types import DType, ReduceOp, op_allowed  # noqa: E402
from transports import base  # noqa: E402

BUDGET = float(os.environ.get("DEVICE_CHECK_BUDGET", "200"))
RESULTS: list[tuple[str, str, str]] = []   # (status, name, detail)
_running: list[str] = []                   # the check in progress, for the watchdog


def check(name: str, fn, *args) -> None:
    t0 = time.monotonic()
    _running[:] = [name]
    try:
        fn(*args)
    except Exception as e:  # every failure is reported, the sweep goes on
        RESULTS.append(("FAIL", name, f"{type(e).__name__}: {e}"))
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        if os.environ.get("DEVICE_CHECK_TRACE"):
            traceback.print_exc()
        return
    finally:
        _running.clear()
    RESULTS.append(("PASS", name, f"{time.monotonic() - t0:.2f}s"))
    print(f"PASS {name} ({time.monotonic() - t0:.1f} s)", flush=True)


def not_run(name: str, why: str) -> None:
    RESULTS.append(("NOT RUN", name, why))
    print(f"NOT RUN {name}: {why}", flush=True)


def summary() -> int:
    counts = {s: sum(1 for r in RESULTS if r[0] == s) for s in ("PASS", "FAIL", "NOT RUN")}
    print("\n==== summary:", ", ".join(f"{v} {k.lower()}" for k, v in counts.items()), flush=True)
    for status, name, detail in RESULTS:
        if status != "PASS":
            print(f"  {status:7} {name}: {detail}", flush=True)
    if counts["FAIL"]:
        return 1
    return 0 if counts["PASS"] else 2


def _watchdog() -> None:
    """If the budget runs out, a check hangs: show where, count it failed, report, exit."""
    time.sleep(BUDGET)
    name = _running[0] if _running else "between checks"
    print(f"\nFAIL budget of {BUDGET:g} s exhausted while running: {name}; every thread's stack:", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    RESULTS.append(("FAIL", name, f"still running after the {BUDGET:g} s budget (hang)"))
    print("RESULTS " + json.dumps(RESULTS), flush=True)
    os._exit(1)


def _run_ranks(fn, n: int, *args, **kw):
    from harness import run_ranks
    return run_ranks(fn, n, *args, timeout=90, **kw)


# ---- header ------------------------------------------------------------------------------------------
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def header() -> None:
    lines = [f"python {sys.version.split()[0]}"]
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        lines.append(f"GPU, driver, memory: {smi.stdout.strip() or smi.stderr.strip()}")
    except (OSError, subprocess.TimeoutExpired) as e:
        lines.append(f"nvidia-smi: {e}")
    try:
        import torch
        lines.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA available: "
                     f"{torch.cuda.is_available()}, devices: {torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    except ImportError:
        lines.append("torch absent")
    lines.append(f"nccl4py {_version('nccl4py')}, cuda-bindings {_version('cuda-bindings')}, cupy "
                 f"{_version('cupy-cuda13x') if _version('cupy-cuda13x') != 'absent' else _version('cupy-cuda12x')}")
    try:
        from transports.nccl import _nccl
        code = _nccl.get_version() if _nccl is not None else None
        lines.append(f"libnccl {code // 10000}.{code // 100 % 100}.{code % 100}" if code else "libnccl: nccl4py absent")
    except Exception as e:  # noqa: BLE001 - the header reports, never fails
        lines.append(f"libnccl: {type(e).__name__}: {e}")
    lines.append("transports that can run here: "
                 + ", ".join(n for n in base.names() if base.unavailable_reason(n) is None))
    print("device check\n  " + "\n  ".join(lines), flush=True)


def cuda_reason() -> str | None:
    """Why CUDA tensors cannot be made here (None when they can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


# ---- NCCL, world of one ----------------------------------------------------------------------------
def _torch_dtypes(torch):
    return {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16, DType.FLOAT32: torch.float32,
            DType.FLOAT64: torch.float64, DType.INT8: torch.int8, DType.INT16: torch.int16,
            DType.INT32: torch.int32, DType.INT64: torch.int64, DType.UINT8: torch.uint8,
            DType.BOOL: torch.bool}


def _data(torch, dtype, n):
    base_ = torch.arange(n, device="cuda") % 7
    return (base_ % 2).bool() if dtype is torch.bool else base_.to(dtype)


def _nccl_can_reduce(d: DType, op: ReduceOp) -> bool:
    from transports.nccl import reduction_types
    try:
        reduction_types(d, op)
        return True
    except comm.InvalidArgument:
        return False


def nccl_sweep(world, torch) -> None:
    n = 1001
    for d, td in _torch_dtypes(torch).items():
        tag = d.name.lower()
        x = _data(torch, td, n)

        def movement(x=x, td=td):
            out = torch.empty(n, dtype=td, device="cuda")
            world.all_gather(out, x)
            assert torch.equal(out, x)
            y = x.clone()
            world.broadcast(y, root=0)
            assert torch.equal(y, x)
            world.gather(out, x, root=0)
            assert torch.equal(out, x)
            world.scatter(out, x, root=0)
            assert torch.equal(out, x)
            world.all_to_all(out, x)
            assert torch.equal(out, x)
            world.all_to_all(out[:n - 1], x[:n - 1], out_splits=[n - 1], in_splits=[n - 1])
            assert torch.equal(out[:n - 1], x[:n - 1])
            inplace = x.clone()
            world.all_gather(inplace, inplace)        # in place: the input is the output's slot 0
            assert torch.equal(inplace, x)
        check(f"nccl {tag} all_gather/broadcast/gather/scatter/all_to_all(v)", movement)

        for op in ReduceOp:
            if not op_allowed(op, d):
                continue
            name = f"nccl {tag} {op.name}"
            if not _nccl_can_reduce(d, op):
                def refused(op=op, x=x):
                    try:
                        world.all_reduce(x.clone(), op=comm.premul_sum(2.0) if op is ReduceOp.PREMUL_SUM else op)
                    except comm.InvalidArgument as e:
                        assert "NCCL" in str(e)
                        return
                    raise AssertionError("expected InvalidArgument")
                check(f"{name} refused with InvalidArgument", refused)
                continue

            def reductions(op=op, x=x, td=td):
                arg = comm.premul_sum(2.0) if op is ReduceOp.PREMUL_SUM else op
                want = x * 2 if op is ReduceOp.PREMUL_SUM else x   # one rank: identity, or scaled
                y = x.clone()
                world.all_reduce(y, op=arg)
                assert torch.equal(y, want), (y[:8], want[:8])
                out = torch.empty_like(x)
                world.all_reduce(x, op=arg, out=out)
                assert torch.equal(out, want)
                world.reduce_scatter(out, x, op=arg)
                assert torch.equal(out, want)
                world.reduce(x, root=0, op=arg, out=out)
                assert torch.equal(out, want)
                work = world.all_reduce(y.copy_(x), op=arg, async_op=True)
                work.wait()
                assert work.is_completed() and torch.equal(y, want)
            check(name, reductions)


def nccl_lifecycle(world, torch) -> None:
    def empty_and_barrier():
        z = torch.empty(0, device="cuda")
        world.all_reduce(z)
        world.barrier()
        world.barrier(async_op=True).wait()
    check("nccl empty tensor and barrier", empty_and_barrier)

    def stream_order():
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = torch.ones(1 << 20, device="cuda")
            world.all_reduce(x, op=comm.premul_sum(3.0))    # enqueued on s, after the fill
            assert float(x.sum()) == 3.0 * (1 << 20)
    check("nccl on the caller's current stream", stream_order)

    def split():
        sub = world.split(0)
        x = torch.ones(10, device="cuda")
        sub.all_reduce(x)
        assert float(x.sum()) == 10.0
        sub.close()
    check("nccl split (ncclCommSplit)", split)

    def post_does_not_block():
        # the GPU is kept busy on the caller's stream; posting must return long before it is done
        torch.cuda._sleep(1_000_000_000)                 # about half a second or more
        x = torch.ones(1 << 20, device="cuda")
        t0 = time.monotonic()
        work = world.all_reduce(x, op=comm.premul_sum(2.0), async_op=True)
        posted = time.monotonic() - t0
        pending = not work.is_completed()
        work.wait()
        assert posted < 0.2 and pending, (posted, pending)
        assert float(x.sum()) == 2.0 * (1 << 20)           # it ran after the fill (stream order)
    check("nccl async post returns while the GPU is busy; result after the producer", post_does_not_block)

    def unique_id():
        from transports.nccl import NcclTransport, _nccl
        uid = NcclTransport._nccl_call(_nccl.get_unique_id, 0, "init")
        raw = bytes(uid)
        assert len(raw) == 128 and bytes(_nccl.UniqueId.from_buffer(bytearray(raw))) == raw
    check("nccl unique id through the error mapping, bytes round trip", unique_id)

    def abort():
        other = comm.init(transport="nccl", master_port=_port())
        other.abort()
        try:
            other.all_reduce(torch.ones(4, device="cuda"))
        except comm.Aborted:
            return
        finally:
            other.close()
        raise AssertionError("an aborted communicator took work")
    check("nccl abort", abort)


def _port() -> int:
    from comm.bootstrap.rendezvous import free_port
    return free_port()




def section_nccl() -> None:
    reason = base.unavailable_reason("nccl") or cuda_reason()
    if reason is not None:
        return not_run("nccl (world of one, and two ranks on one GPU)", reason)
    import torch
    world = comm.init(transport="nccl", master_port=_port())
    try:
        nccl_sweep(world, torch)
        nccl_lifecycle(world, torch)
    finally:
        world.close()

    def shared_gpu():
        from ranks import nccl_shared_gpu
        for message, seconds in _run_ranks(nccl_shared_gpu, 2, init=False):
            assert "share GPU" in message and seconds < 30, (message, seconds)
    check("nccl refuses two ranks on one GPU on every rank, before init (no hang)", shared_gpu)


# ---- torch backend -----------------------------------------------------------------------------------
def section_torch_backend() -> None:
    reason = cuda_reason()
    if reason is not None:
        return not_run("torch backend on CUDA (world of one via nccl, two ranks staged, DDP)", reason)
    import torch
    import torch.distributed as dist
    importlib.import_module("comm.torch")   # registers the "comm" backend
    nccl_reason = base.unavailable_reason("nccl")
    if nccl_reason is not None:
        not_run("torch backend 'comm' on CUDA via nccl (world of one)", nccl_reason)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))

        def cuda_path():
            dist.init_process_group("comm", rank=0, world_size=1)
            try:
                x = torch.arange(8, dtype=torch.float32, device="cuda")
                dist.all_reduce(x)
                assert torch.equal(x.cpu(), torch.arange(8, dtype=torch.float32))
                out = [torch.empty(8, device="cuda")]
                dist.all_gather(out, x)
                assert torch.equal(out[0], x)
                # Work.wait() orders the current stream and returns while the GPU is still busy
                torch.cuda._sleep(1_000_000_000)
                y = torch.ones(1 << 20, device="cuda")
                work = dist.all_reduce(y, op=dist.ReduceOp.AVG, async_op=True)
                t0 = time.monotonic()
                work.wait()
                waited = time.monotonic() - t0
                assert waited < 0.2 and not work.is_completed(), (waited, work.is_completed())
                work.synchronize()                              # this one blocks
                assert work.is_completed() and float(y.sum()) == float(1 << 20)
                fut = dist.all_reduce(y, async_op=True).get_future()
                value = fut.wait()
                assert value[0].is_cuda and float(value[0].sum()) == float(1 << 20)
                dist.barrier()
            finally:
                dist.destroy_process_group()
        check("torch backend 'comm' on CUDA via nccl (world of one): wait orders the stream, "
              "synchronize blocks, futures carry the device", cuda_path)

    def staged():
        from ranks import torch_staged
        for notices in _run_ranks(torch_staged, 2, init=False):
            assert len(notices) == 1, notices
    check("torch backend on CUDA, two ranks on one GPU: agreed staged path", staged)

    def ddp():
        from ranks import ddp_staged
        moved = _run_ranks(ddp_staged, 2, init=False)
        assert moved[0] == moved[1]
    check("DDP on CUDA, two ranks on one GPU (staged): gradients averaged, parameters equal", ddp)


def section_comm_staged() -> None:
    reason = cuda_reason()
    if reason is not None:
        return not_run("comm API on CUDA tensors over native (staged), two ranks", reason)
    from ranks import comm_staged
    check("comm API on CUDA tensors over native (staged), two ranks", lambda: _run_ranks(comm_staged, 2))


def section_window_staged() -> None:
    name = "window put / get with CUDA tensors over native (staged): CMA, shm messages, TCP"
    reason = cuda_reason()
    if reason is not None:
        return not_run(name, reason)
    from ranks import window_staged
    # the window paths of one host (CMA into a pinned tensor, a store into a mapped allocated
    # window, messages on the shm rings) and TCP
    for label, env, allocated in (("CMA", {}, False), ("mapped", {}, True),
                                  ("shm messages", {"COMM_CMA": "0"}, False), ("TCP", {"COMM_CHANNELS": "tcp"}, False)):
        def windows(env=env, allocated=allocated):
            got = _run_ranks(window_staged, 2, allocated, env=env)
            assert all(len(notices) == 1 for notices, _ in got), got   # the staging was said
            print(f"    path to the peer's window per rank: {[path for _, path in got]}", flush=True)
        check(f"window put / get with CUDA tensors over native {label} (staged), window "
              f"{'allocated' if allocated else 'pinned torch'}, two ranks", windows)


# ---- CUDA-array-interface and DLPack inputs ------------------------------------------------------------
class BareCAI:
    """Only __cuda_array_interface__ (what CuPy and Numba arrays offer), over a torch tensor."""

    def __init__(self, t):
        self.t, self.__cuda_array_interface__ = t, t.__cuda_array_interface__


class BareDLPack:
    """Only the DLPack protocol (what JAX and others offer), over a torch tensor."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def section_array_inputs() -> None:
    reason = cuda_reason()
    if reason is not None:
        return not_run("CUDA-array-interface and DLPack inputs", reason)
    import torch
    try:
        import cupy
    except ImportError:
        cupy = None
    worlds = [("native (staged)", "native")]
    if base.unavailable_reason("nccl") is None:
        worlds.append(("nccl", "nccl"))
    for label, transport in worlds:
        world = comm.init(transport=transport, rank=0, world_size=1, master_port=_port())
        try:
            def inputs(world=world):
                t = torch.arange(12, dtype=torch.float32, device="cuda")
                world.all_reduce(BareCAI(t), op=comm.premul_sum(2.0))
                world.all_reduce(BareDLPack(t), op=comm.premul_sum(3.0))
                torch.cuda.synchronize()
                assert torch.equal(t.cpu(), torch.arange(12, dtype=torch.float32) * 6), t
                if cupy is not None:
                    c = cupy.arange(12, dtype=cupy.float32)
                    world.all_reduce(c, op=comm.premul_sum(2.0))
                    assert float(c.sum()) == 2 * 66.0
            check(f"{label}: __cuda_array_interface__ {'(CuPy and bare)' if cupy else '(bare; CuPy absent)'} "
                  "and DLPack inputs", inputs)
        finally:
            world.close()


# ---- verbs -------------------------------------------------------------------------------------------
def section_verbs() -> None:
    reason = base.unavailable_reason("verbs")
    if reason is not None:
        return not_run("verbs two ranks", reason)
    from comm import _native
    from transports.verbs import VerbsTransport
    print("    " + _native.net_describe("verbs", VerbsTransport.net_options()).replace("\n", "\n    "))
    from harness import run_ranks
    from test_verbs import _ring_exchange
    check("verbs two ranks, host memory", lambda: run_ranks(_ring_exchange, 2, transport="verbs", timeout=120))
    check("verbs two ranks, CUDA tensors (staged)",
          lambda: run_ranks(_ring_exchange, 2, "cuda", transport="verbs", timeout=120))
    check("verbs window over RDMA WRITE / READ (COMM_WINDOW_RMA=1)", _verbs_window)


def _verbs_window() -> None:
    from harness import run_ranks
    from test_verbs import _window_over_rdma
    env = {"COMM_WINDOW_RMA": "1", "COMM_CMA": "0"}   # one host: no CMA, so the NIC carries it
    got = run_ranks(_window_over_rdma, 2, transport="verbs", env=env, timeout=120)
    assert got == [True, True], got


def section_self_test_hang() -> None:
    """Only with DEVICE_CHECK_SELF_TEST=hang (tests/test_device_check.py): a check that never
    ends, so the watchdog's report of a hang is itself tested."""
    check("self-test: a check that hangs", lambda: threading.Event().wait())


SECTIONS = ((section_self_test_hang,) if os.environ.get("DEVICE_CHECK_SELF_TEST") == "hang" else ()) + (
    section_nccl, section_torch_backend, section_comm_staged, section_window_staged, section_array_inputs,
    section_verbs)


def run_section(name: str) -> int:
    """In a child process: one section, its results as a JSON line for the parent."""
    threading.Thread(target=_watchdog, name="device-check-watchdog", daemon=True).start()
    section = next(s for s in SECTIONS if s.__name__ == name)
    try:
        section()
    except Exception as e:
        RESULTS.append(("FAIL", name, f"{type(e).__name__}: {e}"))
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()
    print("RESULTS " + json.dumps(RESULTS), flush=True)
    return 0


def main() -> int:
    """Each section in a process of its own: a crash (a segfault in a library) or a hang in
    one is reported with the Python stack faulthandler prints, and the others still run."""
    header()
    end = time.monotonic() + BUDGET
    for section in SECTIONS:
        left = end - time.monotonic()
        if left < 1:
            not_run(section.__name__, f"the {BUDGET:g} s budget ran out")
            continue
        env = dict(os.environ, DEVICE_CHECK_BUDGET=str(int(left)))
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", __file__, "--section", section.__name__],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        # a hang that holds the GIL stops the child's watchdog too: the parent's last resort
        killer = threading.Timer(left + 15, proc.kill)
        killer.start()
        got, last = None, "none"
        for line in proc.stdout:
            if line.startswith("RESULTS "):
                got = json.loads(line[len("RESULTS "):])
                continue
            print(line, end="", flush=True)
            if line.startswith(("PASS ", "FAIL ", "NOT RUN ")):
                last = line.strip()
        code = proc.wait()
        killer.cancel()
        if got is not None:
            RESULTS.extend(tuple(r) for r in got)
        if code != 0 or got is None:
            why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            RESULTS.append(("FAIL", section.__name__, f"the section's process ended early ({why}); "
                                                       f"its last result: {last}"))
            print(f"FAIL {section.__name__}: {why}", flush=True)
    return summary()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--section"]:
        sys.exit(run_section(sys.argv[2]))
    sys.exit(main())
