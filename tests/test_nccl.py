"""NCCL transport: mapping tables and the no-GPU path run everywhere; operations on a GPU skip
with the reason (nccl4py missing, or "no CUDA device"). tests/device/run.py is the full sweep."""
from __future__ import annotations

import numpy as np
import pytest

import comm
from comm.core.types import DType, ReduceOp, op_allowed
from transports import base
from transports import nccl as tn

NCCL_REASON = base.unavailable_reason("nccl")


def test_dtype_table_matches_nccl_codes():
    assert tn.NCCL_DTYPE[DType.FLOAT32] == 7 and tn.NCCL_DTYPE[DType.BFLOAT16] == 9
    assert DType.INT16 not in tn.NCCL_DTYPE          # NCCL has no 16-bit integer
    assert tn.NCCL_DTYPE[DType.BOOL] == tn.NCCL_UINT8
    nccl = pytest.importorskip("nccl.core", reason="nccl4py not installed: codes checked by value only")
    names = {DType.INT8: "INT8", DType.UINT8: "UINT8", DType.INT32: "INT32", DType.INT64: "INT64",
             DType.FLOAT16: "FLOAT16", DType.FLOAT32: "FLOAT32", DType.FLOAT64: "FLOAT64",
             DType.BFLOAT16: "BFLOAT16", DType.BOOL: "UINT8"}
    for dtype, name in names.items():
        assert tn.NCCL_DTYPE[dtype] == int(getattr(nccl.NcclDataType, name)), dtype
    for op, name in {ReduceOp.SUM: "SUM", ReduceOp.PRODUCT: "PROD", ReduceOp.MAX: "MAX",
                     ReduceOp.MIN: "MIN", ReduceOp.AVG: "AVG"}.items():
        assert tn.NCCL_OP[op] == int(getattr(nccl.NcclRedOp, name)), op


# Pairs op_allowed refuses never reach a transport (the communicator rejects them first).
@pytest.mark.parametrize("dtype, op", [(d, o) for d in DType for o in ReduceOp if op_allowed(o, d)])
def test_reduction_types_cover_every_valid_pair(dtype, op):
    unsupported = dtype is DType.INT16 or (op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
                                           and dtype is not DType.BOOL) \
        or (dtype is DType.BOOL and op is ReduceOp.BXOR)
    if unsupported:
        with pytest.raises(comm.InvalidArgument, match="NCCL"):
            tn.reduction_types(dtype, op)
        return
    nccl_dtype, nccl_op = tn.reduction_types(dtype, op)
    assert nccl_dtype == tn.NCCL_DTYPE[dtype]
    if op is ReduceOp.PREMUL_SUM:
        assert nccl_op is None                       # created per call
    elif dtype is DType.BOOL:                        # or = max, and = min on 0/1 bytes
        assert nccl_op == (tn.NCCL_MAX if op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.BOR) else tn.NCCL_MIN)
    else:
        assert nccl_op == tn.NCCL_OP[op]


@pytest.mark.parametrize("dtype, bits", [(DType.FLOAT32, np.float32(0.25).view(np.uint32)),
                                         (DType.FLOAT64, np.float64(0.25).view(np.uint64)),
                                         (DType.FLOAT16, np.float16(0.25).view(np.uint16)),
                                         (DType.BFLOAT16, np.uint16(0x3E80))])
def test_premul_scalar_has_the_reduction_type(dtype, bits):
    scalar = tn.premul_scalar(dtype, 0.25)
    assert scalar.nbytes == dtype.itemsize
    assert scalar.view(np.dtype(f"u{dtype.itemsize}"))[0] == bits


def test_unavailable_without_gpu_says_why():
    if NCCL_REASON is None:
        pytest.skip("a CUDA device and nccl4py are present")
    assert "no CUDA device" in NCCL_REASON or "nccl4py is not installed" in NCCL_REASON
    with pytest.raises(comm.TransportUnavailable, match="cannot run here"):
        comm.init(transport="nccl")


needs_gpu = pytest.mark.skipif(NCCL_REASON is not None, reason=f"nccl: {NCCL_REASON}")


@needs_gpu
def test_world_of_one_premul_async_and_tag_refusal():
    torch = pytest.importorskip("torch")
    from comm.core.buffers import as_buffer
    from transports.base import OpDesc, OpKind
    with comm.init(transport="nccl") as world:
        x = torch.arange(10, dtype=torch.float32, device="cuda")
        work = world.all_reduce(x, op=comm.premul_sum(2.0), async_op=True)
        work.wait()
        assert torch.equal(x.cpu(), torch.arange(10, dtype=torch.float32) * 2)
        buf = as_buffer(x, op="send", writable=False)
        with pytest.raises(comm.InvalidArgument, match="no tags"):
            world.session.transport.post(OpDesc(OpKind.SEND, buf, None, buf.dtype, buf.count, peer=0, tag=3), True)


# ---- device choice and the agreement before NCCL is entered (pure, and over a real store) ------
def test_device_choice_one_visible_gpu_current_device_local_rank():
    assert tn.choose_device(1, 0, 3) == 0        # CUDA_VISIBLE_DEVICES / --gpus-per-task: local rank 3 is fine
    assert tn.choose_device(8, 5, 0) == 5        # the process chose one (torch.cuda.set_device)
    assert tn.choose_device(8, 0, 3) == 3        # otherwise the local rank
    with pytest.raises(comm.TransportUnavailable, match="local rank 4 would take CUDA device 4"):
        tn.choose_device(4, 0, 4)
    with pytest.raises(comm.TransportUnavailable, match="no CUDA device"):
        tn.choose_device(0, 0, 0)


def test_gpu_records_round_trip_with_binary_payload():
    from comm.core import gpu
    uid = bytes(range(256))[:128]                  # a unique id may hold any byte, "|" included
    assert gpu.decode_record(gpu.encode_record("0000:3b:00.0", None, uid)) == ("0000:3b:00.0", None, uid)
    assert gpu.decode_record(gpu.encode_record(None, "no CUDA device")) == (None, "no CUDA device", b"")


def test_gpu_problem_names_failed_ranks_then_shared_gpus():
    from comm.core.gpu import gpu_problem
    ok = [("0000:3b:00.0", None, b""), ("0000:5e:00.0", None, b"")]
    assert gpu_problem(ok) is None
    failed = gpu_problem([ok[0], (None, "local rank 1 would take CUDA device 1", b"")])
    assert failed.startswith("rank 1: local rank 1 would take")
    shared = gpu_problem([ok[0], ok[1], ok[0]])
    assert "ranks 0, 2 share GPU 0000:3b:00.0" in shared and "one GPU per rank" in shared


def _agree(world):
    from comm.core import gpu
    from comm import staging
    chosen = staging.cuda_transport(world.session.ctx.store.scoped("cuda-agree"), "native", None)
    return chosen, [n for n in gpu._noticed if "pinned host memory over the native" in n]


@pytest.mark.skipif(NCCL_REASON is None, reason="nccl can run here: this checks the fallback without it")
def test_ranks_agree_on_the_staged_path_without_nccl():
    from harness import run_ranks
    for chosen, notices in run_ranks(_agree, 2):
        assert chosen == "native"
        assert len(notices) == 1 and NCCL_REASON.split(";")[0] in notices[0]   # says why, once


def test_missing_library_and_unique_id_errors_are_comm_errors():
    if tn._nccl is None:
        pytest.skip("nccl4py not installed: the mapping wraps its NCCLError")
    err = tn._nccl.NCCLError(2)   # ncclSystemError: a peer or the network went away
    def fail():
        raise err
    with pytest.raises(comm.PeerFailure, match="NCCL"):
        tn.NcclTransport._nccl_call(fail, 0, "init")
