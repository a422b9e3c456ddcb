"""Device check for a GPU machine (a few minutes): python tests/device/run.py

1. NCCL, world size 1 (one GPU cannot host two NCCL ranks), through comm.init(transport="nccl")
   with torch CUDA tensors: every collective and every dtype, reductions with every op NCCL
   takes for that dtype, async Work, in-place forms, all_to_all with splits, split, abort.
2. The torch backend's CUDA path (comm.torch_backend, "comm" process group of one) when present.
3. Verbs: discovery; with an RDMA device, a two-rank run over loopback (host and CUDA memory).

Prints one line per check and a summary; exits 1 on any failure, 2 when nothing could run
(a section that cannot run here is NOT RUN, never counted as passed).
"""
from __future__ import annotations

import importlib
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

import comm  # noqa: E402
from comm.types import DType, ReduceOp, op_allowed  # noqa: E402
from transports import base  # noqa: E402

RESULTS: list[tuple[str, str, str]] = []   # (status, name, detail)


def check(name: str, fn, *args) -> None:
    t0 = time.monotonic()
    try:
        fn(*args)
    except Exception as e:  # every failure is reported, the sweep goes on
        RESULTS.append(("FAIL", name, f"{type(e).__name__}: {e}"))
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        if os.environ.get("DEVICE_CHECK_TRACE"):
            traceback.print_exc()
        return
    RESULTS.append(("PASS", name, f"{time.monotonic() - t0:.2f}s"))
    print(f"PASS {name}", flush=True)


def not_run(name: str, why: str) -> None:
    RESULTS.append(("NOT RUN", name, why))
    print(f"NOT RUN {name}: {why}", flush=True)


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
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section_nccl() -> None:
    reason = base.unavailable_reason("nccl")
    if reason is not None:
        return not_run("nccl", reason)
    try:
        import torch
    except ImportError:
        return not_run("nccl", "torch is not installed")
    world = comm.init(transport="nccl", master_port=_port())
    try:
        nccl_sweep(world, torch)
        nccl_lifecycle(world, torch)
    finally:
        world.close()


# ---- torch backend ---------------------------------------------------------------------------------
def section_torch_backend() -> None:
    try:
        import torch
        import torch.distributed as dist
        importlib.import_module("comm.torch_backend")   # registers the "comm" backend
    except ImportError as e:
        return not_run("torch backend", f"cannot import it: {e}")
    if not torch.cuda.is_available():
        return not_run("torch backend", "torch sees no CUDA device")
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
            work = dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True)
            work.wait()
            dist.barrier()
        finally:
            dist.destroy_process_group()
    check("torch backend 'comm' on CUDA tensors (world of one)", cuda_path)


# ---- verbs -----------------------------------------------------------------------------------------
def section_verbs() -> None:
    reason = base.unavailable_reason("verbs")
    if reason is not None:
        return not_run("verbs", reason)
    from harness import run_ranks
    from test_verbs import _ring_exchange
    check("verbs two ranks, host memory", lambda: run_ranks(_ring_exchange, 2, transport="verbs", timeout=120))


def main() -> int:
    print(f"device check: python {sys.version.split()[0]}, "
          f"COMM transports here: {', '.join(n for n in base.names() if base.unavailable_reason(n) is None)}",
          flush=True)
    for section in (section_nccl, section_torch_backend, section_verbs):
        try:
            section()
        except Exception as e:
            RESULTS.append(("FAIL", section.__name__, f"{type(e).__name__}: {e}"))
            print(f"FAIL {section.__name__}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
    counts = {s: sum(1 for r in RESULTS if r[0] == s) for s in ("PASS", "FAIL", "NOT RUN")}
    print("\n==== summary:", ", ".join(f"{v} {k.lower()}" for k, v in counts.items()))
    for status, name, detail in RESULTS:
        if status != "PASS":
            print(f"  {status:7} {name}: {detail}")
    if counts["FAIL"]:
        return 1
    return 0 if counts["PASS"] else 2


if __name__ == "__main__":
    sys.exit(main())
