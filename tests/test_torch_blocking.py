"""The torch backend's blocking fast path (torch's own blocking all_reduce / broadcast of one plain
CPU tensor go straight to the communicator's blocking call) gives what gloo gives, and what the
general path gives where gloo has no such op; every other form still takes the general path.

One launch at world size 2 runs every check on a comm default group and a gloo subgroup side by
side.
"""
import datetime
import time

import pytest
from torch_ranks import process_group, ranks  # noqa: F401  (a fixture)

from comm.core import config
from transports import base

torch = pytest.importorskip("torch")

TRANSPORT = config.get("COMM_TRANSPORT")
pytestmark = pytest.mark.skipif(base.unavailable_reason(TRANSPORT) is not None,
                                reason=f"transport {TRANSPORT}: {base.unavailable_reason(TRANSPORT)}")

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
OPS = ("SUM", "PRODUCT", "MIN", "MAX")
BITWISE = ("BAND", "BOR", "BXOR")


def _value(rank, dtype, n=5):
    return (torch.arange(n) + 3 * rank + 1).to(getattr(torch, dtype))


def _side_by_side(dist, group, rank):
    """dist.all_reduce and dist.broadcast (torch's blocking form) over every dtype and op gloo
    has, plus complex and non-contiguous tensors, which must not take the fast path's shortcut."""
    out = {}
    for dtype in DTYPES:
        for op in OPS + (() if getattr(torch, dtype).is_floating_point else BITWISE):
            t = _value(rank, dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
            out[dtype, op] = t.tolist()
        t = _value(rank, dtype)
        dist.broadcast(t, src=1, group=group)
        out[dtype, "broadcast"] = t.tolist()
    c = torch.full((3,), complex(rank + 1, -rank))   # torch passes its real view to the backend
    dist.all_reduce(c, group=group)
    out["complex"] = c.tolist()
    nc = (torch.arange(12.0).reshape(3, 4) + rank).t()   # not contiguous: staged and copied back
    dist.all_reduce(nc, group=group)
    out["non-contiguous"] = nc.tolist()
    nc = (torch.arange(12.0).reshape(3, 4) * (rank + 1)).t()
    dist.broadcast(nc, src=1, group=group)
    out["non-contiguous broadcast"] = nc.tolist()
    return out


def _general(pg, t, op):
    """`op` on the general path: asynchronous, then waited for."""
    from torch._C._distributed_c10d import AllreduceOptions

    opts = AllreduceOptions()
    opts.reduceOp, opts.asyncOp = op, True
    pg.allreduce([t], opts).wait()
    return t


def _blocking(rank, size, port):
    from torch._C._distributed_c10d import AllreduceOptions, BroadcastOptions

    with process_group(rank, size, port) as dist:
        world, gloo = dist.group.WORLD, dist.new_group(backend="gloo")
        checks = {"gloo": [_side_by_side(dist, g, rank) for g in (world, gloo)]}

        # ops gloo lacks: the fast path (AVG) or its fall-back (PREMUL_SUM) against the general path
        for name, op in (("AVG", dist.ReduceOp.AVG), ("PREMUL_SUM", dist._make_nccl_premul_sum(0.5))):
            for dtype in ("float32", "bfloat16"):
                t = _value(rank, dtype)
                dist.all_reduce(t, op=op)
                checks[name, dtype] = (t.tolist(), _general(world, _value(rank, dtype), op).tolist())

        # an explicit blocking call on the group: a completed, waitable Work carrying the output
        t, opts = _value(rank, "float32"), AllreduceOptions()
        opts.asyncOp = False
        w = world.allreduce([t], opts)
        checks["work"] = (isinstance(w, dist.Work), w.is_completed(), w.wait(), w.is_success(),
                          w.exception() is None, w.get_future().value()[0] is t, w.result()[0] is t,
                          t.tolist())
        # which path a call took: torch's blocking form the fast one, everything else the general one
        works = [world.allreduce([torch.ones(2)], o) for o in _options()]
        bopts = BroadcastOptions()
        bopts.asyncOp, bopts.rootRank = False, 1
        works.append(world.broadcast([torch.ones(2)], bopts))
        checks["kinds"] = [type(w).__name__ for w in works if w.wait()]

        # a timeout the caller set is honoured (general path), as a torch timeout error
        late = dist.new_group(timeout=datetime.timedelta(seconds=30))
        if rank == 0:
            opts = AllreduceOptions()
            opts.asyncOp, opts.timeout = False, datetime.timedelta(seconds=1)
            try:
                late.allreduce([torch.ones(2)], opts)
                checks["timeout"] = "no error"
            except dist.DistBackendError as e:
                checks["timeout"] = "Timed out" in str(e)
        else:
            time.sleep(3)
            dist.all_reduce(torch.ones(2), group=late)   # completes rank 0's, which the engine still runs
        dist.barrier()
    return checks


def _options():
    """Options objects for: torch's blocking form, async, blocking with its own timeout."""
    from torch._C._distributed_c10d import AllreduceOptions

    plain, asynchronous, timed = AllreduceOptions(), AllreduceOptions(), AllreduceOptions()
    plain.asyncOp = timed.asyncOp = False   # the options' own default is asynchronous
    asynchronous.asyncOp = True
    timed.timeout = datetime.timedelta(seconds=20)
    return [plain, asynchronous, timed]


def test_blocking_fast_path_matches_gloo_and_general_path(ranks):
    results = ranks(2, _blocking, timeout=180)
    for rank, c in enumerate(results):
        comm_side, gloo_side = c["gloo"]
        assert comm_side.keys() == gloo_side.keys()
        for key in comm_side:
            assert comm_side[key] == gloo_side[key], (rank, key)
        for name in ("AVG", "PREMUL_SUM"):
            for dtype in ("float32", "bfloat16"):
                fast, general = c[name, dtype]
                assert fast == general, (rank, name, dtype)
        want = [float(2 * i + 5) for i in range(5)]   # (i + 1) + (i + 4)
        assert c["work"] == (True, True, True, True, True, True, True, want), rank
        assert c["kinds"] == ["DoneWork", "TorchWork", "TorchWork", "DoneWork"], rank
    assert results[0]["timeout"] is True
