"""The "comm" backend next to gloo: every argument form torch's backends accept, all_gather
_coalesced, receives from any source (also under the profilers), sparse all_reduce, per-call
timeouts as torch's errors, device registration (async checkpointing, _set_pg_timeout), and a
clean exit with or without destroy_process_group.

One launch per world size runs every check, on a comm default group and a gloo subgroup side
by side, and compares their results.
"""
import datetime
import os
import subprocess
import sys
import tempfile
import time
import warnings

import pytest
from harness import ROOT, free_port, slow
from torch_ranks import process_group, ranks  # noqa: F401  (a fixture)

from comm.core import config
from transports import base

torch = pytest.importorskip("torch")

TRANSPORT = config.get("COMM_TRANSPORT")
pytestmark = pytest.mark.skipif(base.unavailable_reason(TRANSPORT) is not None,
                                reason=f"transport {TRANSPORT}: {base.unavailable_reason(TRANSPORT)}")


def _argument_forms(dist, pg, rank, n):
    """Every short form and default-options form of the ProcessGroup methods, on `pg`."""
    r = float(rank + 1)
    out = {}
    t = torch.full((3,), r)
    pg.allreduce([t]).wait()                                  # opts omitted
    pg.allreduce(t, dist.ReduceOp.MAX).wait()                 # one tensor, op positionally
    pg.allreduce([t], op=dist.ReduceOp.SUM, timeout=datetime.timedelta(seconds=20)).wait()
    out["allreduce"] = t.tolist()
    t = torch.full((2,), r)
    pg.broadcast(t, n - 1).wait()
    pg.broadcast([t]).wait()
    out["broadcast"] = t.tolist()
    results = []
    for call in (lambda t: pg.reduce(t, 0, dist.ReduceOp.MAX), lambda t: pg.reduce([t])):
        t = torch.full((2,), r)   # fresh: what a reduce leaves in non-roots' buffers is unspecified
        call(t).wait()
        results.append(t.tolist() if rank == 0 else None)
    out["reduce"] = results
    outs = [torch.empty(2) for _ in range(n)]
    pg.allgather(outs, torch.full((2,), r)).wait()
    out["allgather"] = [o.tolist() for o in outs]
    outs = [torch.empty(2) for _ in range(n)] if rank == 0 else []
    pg.gather(outs, torch.full((2,), r), 0).wait()
    out["gather"] = [o.tolist() for o in outs]
    o = torch.empty(2)
    pg.scatter(o, [torch.full((2,), 10.0 + i) for i in range(n)] if rank == 0 else [], 0).wait()
    out["scatter"] = o.tolist()
    o = torch.empty(2)
    pg.reduce_scatter(o, [torch.full((2,), r * (i + 1)) for i in range(n)]).wait()
    out["reduce_scatter"] = o.tolist()
    o = torch.empty(n)
    pg.all_to_all_single(o, torch.arange(n, dtype=torch.float32) + 10 * rank, [], []).wait()
    out["all_to_all_single"] = o.tolist()
    pg.barrier().wait()
    pg.barrier(datetime.timedelta(seconds=20)).wait()
    return out


def _all_gather_coalesced(dist, group, rank, n):
    inputs = [torch.full((2, 2), rank + 1.0), torch.empty(0), torch.arange(3.0) + 10 * rank,
              torch.full((2,), complex(rank, -rank)), torch.full((1,), rank + 0.5)]   # one dtype (torch's rule)
    outputs = [[torch.zeros_like(t) for t in inputs] for _ in range(n)]
    dist.all_gather_coalesced(outputs, inputs, group=group)
    return [[t.tolist() for t in per_rank] for per_rank in outputs]


def _uneven(dist, rank, n):
    """torch's uneven forms (gloo has none to compare with): all_gather of tensors of another
    size per rank, reduce_scatter into blocks of another size per rank (all_gather_v /
    reduce_scatter_v underneath), blocking and async."""
    outs = [torch.zeros(q + 1, 2) for q in range(n)]
    dist.all_gather(outs, torch.full((rank + 1, 2), rank + 1.0))
    out = torch.zeros(rank % 2)
    w = dist.reduce_scatter(out, [torch.arange(float(q % 2)) + rank for q in range(n)], async_op=True)
    w.wait()
    return [o.tolist() for o in outs], out.tolist()


def _any_source(dist, group, rank, n, tag):
    """Every other rank sends its rank to rank 0, which receives from any source: blocking recv
    (plain, under the autograd profiler, under torch.profiler), then irecv."""
    from torch.profiler import profile

    rounds = [lambda f: f(), lambda f: _under(torch.autograd.profiler.profile(), f),
              lambda f: _under(profile(), f)]
    got = []
    for k, run in enumerate(rounds):
        if rank == 0:
            senders = []
            for _ in range(n - 1):
                t = torch.zeros(2)
                src = run(lambda: dist.recv(t, group=group, tag=tag + k))
                assert t.tolist() == [float(src)] * 2, (t, src)
                senders.append(src)
            got.append(sorted(senders))
        else:
            dist.send(torch.full((2,), float(rank)), 0, group=group, tag=tag + k)
    if rank == 0:
        works = [(dist.irecv(torch.zeros(1), group=group, tag=tag + 9)) for _ in range(n - 1)]
        for w in works:
            w.wait()
        got.append(sorted(w._source_rank() for w in works))
    else:
        dist.isend(torch.ones(1), 0, group=group, tag=tag + 9).wait()
    return got


def _under(ctx, fn):
    with ctx:
        return fn()


def _sparse(dist, group, rank, n):
    idx = torch.tensor([[rank, rank + 1, 0]])
    val = torch.tensor([[1.0, 2.0], [3.0, 4.0], [float(rank), 1.0]])
    t = torch.sparse_coo_tensor(idx, val, (n + 1, 2))
    dist.all_reduce(t, group=group)
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.int64), torch.zeros(0), (4,))
    dist.all_reduce(empty, group=group)
    return t.to_dense().tolist(), t.is_coalesced(), empty.to_dense().tolist()


def _sparse_ddp(pg, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(4, 1))
    ddp = DDP(model, process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        ids = torch.tensor([[rank + step, 2 * rank + 5, 7]])
        opt.zero_grad()
        ddp(ids).sum().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _parity(rank, size, port):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import comm

    with process_group(rank, size, port) as dist:
        world, gloo = dist.group.WORLD, dist.new_group(backend="gloo")
        checks = {}
        # 1. argument forms
        checks["forms"] = [_argument_forms(dist, pg, rank, size) for pg in (world, gloo)]
        # 2. all_gather_coalesced
        checks["agc"] = [_all_gather_coalesced(dist, g, rank, size) for g in (world, gloo)]
        checks["uneven"] = _uneven(dist, rank, size)
        # 3. receives from any source
        checks["any"] = [_any_source(dist, g, rank, size, tag) for g, tag in ((world, 100), (gloo, 200))]
        # 4. sparse all_reduce, also from DDP over nn.Embedding(sparse=True)
        checks["sparse"] = [_sparse(dist, g, rank, size) for g in (world, gloo)]
        a, b = _sparse_ddp(world, rank), _sparse_ddp(gloo, rank)
        checks["sparse_ddp"] = (a - b).abs().max().item()
        # 5. a per-call timeout: torch's error class and wording
        late = dist.new_group(timeout=datetime.timedelta(seconds=30))
        if rank == 0:
            w = dist.all_reduce(torch.ones(2), group=late, async_op=True)
            try:
                w.wait(timeout=datetime.timedelta(seconds=1))
                checks["timeout"] = "no error"
            except dist.DistBackendError as e:
                checks["timeout"] = (isinstance(e, comm.CommError), "Timed out" in str(e))
        else:
            time.sleep(1.5)
            dist.all_reduce(torch.ones(2), group=late)   # completes rank 0's, which the engine still runs
        # 6. devices: torch sees a backend per device type; async checkpointing; _set_pg_timeout
        checks["devices"] = ([d.type for d in world._device_types],
                             world._get_backend(torch.device("cpu")).name())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=77), world)
        checks["pg_timeout"] = world.timeout
        path = [tempfile.mkdtemp(prefix="comm-dcp-") if rank == 0 else None]
        dist.broadcast_object_list(path, src=0)
        state = {"w": torch.arange(6.0) + rank * 0, "step": torch.tensor(3)}
        dcp.async_save(state, checkpoint_id=path[0]).result()
        loaded = {"w": torch.zeros(6), "step": torch.tensor(0)}
        dcp.load(loaded, checkpoint_id=path[0])
        checks["dcp"] = (loaded["w"].tolist(), loaded["step"].item())
        dist.barrier()
    return checks


@pytest.mark.parametrize("n", [2, *slow(4)])
def test_parity_with_gloo(ranks, n):
    results = ranks(n, _parity, timeout=240)
    peers = list(range(1, n))
    for rank, c in enumerate(results):
        assert c["forms"][0] == c["forms"][1], rank
        assert c["agc"][0] == c["agc"][1], rank
        gathered, scattered = c["uneven"]
        assert gathered == [[[q + 1.0] * 2] * (q + 1) for q in range(n)], rank
        assert scattered == ([] if rank % 2 == 0 else [sum(range(n)) * 1.0]), rank
        if rank == 0:
            assert c["any"][0] == c["any"][1] == [peers] * 4
            assert c["timeout"] == (True, True)
        assert c["sparse"][0] == c["sparse"][1], rank
        assert c["sparse_ddp"] <= 1e-6
        assert c["devices"] == (["cpu", "cuda"], "comm")
        assert c["pg_timeout"] == 77
        assert c["dcp"] == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 3)


# ---- exit ------------------------------------------------------------------------------------
EXIT_SCRIPT = """
import sys, time
import torch, torch.distributed as dist
import comm.torch
rank, port, destroy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
dist.init_process_group("comm", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
seen = []
def slow(fut):
    time.sleep(0.05)
    seen.append(1)
    return fut.value()
work = dist.all_reduce(torch.ones(1000), async_op=True)
chained = work.get_future().then(slow)
work.wait()
print("callbacks before wait returned:", bool(seen), flush=True)
if destroy:
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("destroy", [True, False], ids=["destroy", "no-destroy"])
def test_clean_exit(destroy):
    """An async all_reduce with a slow then() callback, wait(), (destroy_process_group()), exit:
    both ranks exit 0, silently (no abort, no nanobind leak report), with the callback run
    before wait() returned."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT, str(r), str(port), "1" if destroy else "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        noise = [line for line in err.splitlines() if "COMM_SECRET" not in line]
        assert p.returncode == 0, err
        assert "callbacks before wait returned: True" in out
        assert not noise, err
