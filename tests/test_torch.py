"""The torch.distributed backend "comm": collectives, errors, and DDP / FSDP2 / tensor and
pipeline parallelism checked against gloo or a single-process model.

Rank processes are kept across tests (one set of 2 and one of 4); every rank function
initialises a fresh default group on its own port and destroys it at the end.
"""
import copy
import datetime
import threading
import time

import pytest
from harness import slow
from torch_ranks import process_group, ranks  # noqa: F401  (a fixture)

import comm
from comm.core import config
from transports import base

torch = pytest.importorskip("torch")

TRANSPORT = config.get("COMM_TRANSPORT")
pytestmark = pytest.mark.skipif(base.unavailable_reason(TRANSPORT) is not None,
                                reason=f"transport {TRANSPORT}: {base.unavailable_reason(TRANSPORT)}")


# ---- collectives ---------------------------------------------------------------------------
def _collectives(rank, size, port):
    import torch.distributed._functional_collectives as fc
    from torch.testing import assert_close

    with process_group(rank, size, port) as dist:
        n, r = size, float(rank + 1)
        total = n * (n + 1) / 2
        t = torch.full((5,), r)
        dist.all_reduce(t)
        assert_close(t, torch.full((5,), total))
        for op, want in [(dist.ReduceOp.AVG, total / n), (dist.ReduceOp.MAX, float(n)),
                         (dist._make_nccl_premul_sum(0.5), total / 2), (dist.ReduceOp.PREMUL_SUM(2.0), total * 2)]:
            t = torch.full((3,), r)
            dist.all_reduce(t, op=op)
            assert_close(t, torch.full((3,), want))

        # async: the future completes without wait(), and carries the output tensors
        t = torch.full((1000,), r)
        fut = dist.all_reduce(t, async_op=True).get_future()
        deadline = time.monotonic() + 20
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fut.done(), "future did not complete without wait()"
        assert fut.value()[0] is t and t[0].item() == total

        # one Work, three takers at once: wait() here, get_future() and is_completed() on other
        # threads (whoever comes first completes it); each sees the one outcome, none hangs
        for i in range(100):
            t = torch.full((3,), r + i)
            work, futures = dist.all_reduce(t, async_op=True), []
            takers = [threading.Thread(target=lambda: futures.append(work.get_future())),
                      threading.Thread(target=work.is_completed)]
            for taker in takers:
                taker.start()
            work.wait()
            for taker in takers:
                taker.join(20)
            assert t.tolist() == [total + n * i] * 3
            assert futures[0].wait()[0] is t and work.is_success()

        # coalescing: the fast path (allreduce_coalesced) and the device-bracketed form
        a, b = torch.full((3,), r), torch.full((2, 2), r, dtype=torch.float64)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(a)
            dist.all_reduce(b.view(-1)[:2])
        cm.wait()
        assert a.tolist() == [total] * 3 and b.view(-1).tolist() == [total, total, r, r]
        with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
            dist.all_reduce(a)
            dist.broadcast(b, src=n - 1)
        cm.wait()
        assert a[0].item() == total * n and b[0, 0].item() == n * (n + 1) / 2

        t = torch.full((4,), r)
        dist.broadcast(t, src=n - 1)
        assert t.tolist() == [float(n)] * 4
        t = torch.full((4,), r)
        dist.reduce(t, dst=0)
        assert t[0].item() == (total if rank == 0 else r)

        outs = [torch.empty(2, 3) for _ in range(n)]
        dist.all_gather(outs, torch.full((2, 3), r))
        assert [o[1, 2].item() for o in outs] == [float(i + 1) for i in range(n)]
        out = torch.empty(n * 2)
        dist.all_gather_into_tensor(out, torch.full((2,), r))
        assert out.tolist() == [float(i // 2 + 1) for i in range(2 * n)]
        out = torch.empty(3)
        dist.reduce_scatter(out, [torch.full((3,), r * (i + 1)) for i in range(n)])
        assert out.tolist() == [total * (rank + 1)] * 3
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.arange(2.0 * n) * r, op=dist.ReduceOp.AVG)
        assert_close(out, torch.arange(2.0 * rank, 2.0 * rank + 2) * total / n)

        # gather / scatter, a non-contiguous output included
        outs = [torch.empty(2) for _ in range(n)] if rank == 0 else None
        dist.gather(torch.full((2,), r), outs, dst=0)
        if rank == 0:
            assert [o[0].item() for o in outs] == [float(i + 1) for i in range(n)]
        out = torch.empty(2, 4)[:, 1]
        dist.scatter(out, [torch.full((2,), 10.0 + i) for i in range(n)] if rank == 0 else None, src=0)
        assert out.tolist() == [10.0 + rank] * 2

        # all_to_all: list form with uneven sizes, and the single-tensor form with and without splits
        outs = [torch.empty(j + 1) for j in range(n)]  # rank j sends j + 1 elements to everyone
        dist.all_to_all(outs, [torch.full((rank + 1,), 100.0 * rank + i) for i in range(n)])
        assert [o.tolist() for o in outs] == [[100.0 * j + rank] * (j + 1) for j in range(n)]
        out = torch.empty(n)
        dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32) + 10 * rank)
        assert out.tolist() == [10.0 * j + rank for j in range(n)]
        in_splits = [i + 1 for i in range(n)]          # rank sends i + 1 rows to rank i
        out_splits = [rank + 1] * n
        x = torch.cat([torch.full((i + 1, 2), 10.0 * rank + i) for i in range(n)])
        out = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(out, x, out_splits, in_splits)
        assert out[:, 0].tolist() == [10.0 * j + rank for j in range(n) for _ in range(rank + 1)]
        y = fc.all_to_all_single(x, out_splits, in_splits, dist.group.WORLD)
        assert torch.equal(y, out)

        # functional collectives (DTensor and torch.compile go through these)
        assert fc.all_reduce(torch.full((2,), r), "sum", dist.group.WORLD).tolist() == [total] * 2
        g = fc.all_gather_tensor(torch.full((1, 2), r), 0, dist.group.WORLD)
        assert g[:, 0].tolist() == [float(i + 1) for i in range(n)]
        s = fc.reduce_scatter_tensor(torch.arange(2.0 * n), "sum", 0, dist.group.WORLD)
        assert s.tolist() == [2.0 * n * rank, 2.0 * n * rank + n]
        outs = fc.all_gather_into_tensor_coalesced([torch.full((1,), r), torch.full((2,), -r)], dist.group.WORLD)
        assert outs[0].tolist() == [float(i + 1) for i in range(n)] and outs[1].numel() == 2 * n
        outs = fc.reduce_scatter_tensor_coalesced([torch.ones(n), torch.ones(2 * n)], "avg", [0, 0], dist.group.WORLD)
        assert outs[0].tolist() == [1.0] and outs[1].tolist() == [1.0, 1.0]

        # point to point
        if rank == 0:
            dist.send(torch.arange(3.0), dst=1, tag=7)
        elif rank == 1:
            t = torch.empty(3)
            dist.recv(t, src=0, tag=7)
            assert t.tolist() == [0.0, 1.0, 2.0]

        # object collectives are built on the tensor ones
        objs = [None] * n
        dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
        assert objs == [{"rank": i, "s": "x" * i} for i in range(n)]
        lst = [rank, "hello"] if rank == 0 else [None, None]
        dist.broadcast_object_list(lst, src=0)
        assert lst == [0, "hello"]
        got = [None]
        dist.scatter_object_list(got, [("obj", i) for i in range(n)] if rank == 0 else None, src=0)
        assert got[0] == ("obj", rank)

        # subgroups: each half of the world reduces on its own communicator
        halves = [dist.new_group(list(range(0, n, 2))), dist.new_group(list(range(1, n, 2)))]
        mine = halves[rank % 2]
        t = torch.full((2,), r)
        dist.all_reduce(t, group=mine)
        assert t[0].item() == sum(float(i + 1) for i in range(rank % 2, n, 2))
        assert mine.group_name != dist.group.WORLD.group_name
        dist.barrier()
        dist.barrier(group=mine)
        dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=10))
    return True


@pytest.mark.parametrize("n", [2, *slow(4)])
def test_collectives(ranks, n):
    assert ranks(n, _collectives) == [True] * n


def _ring(rank, size, port):
    """Every rank posts its receive before its send (as batch_isend_irecv users and pipeline
    schedules do): the transport must not let a pending receive hold back a later send."""
    with process_group(rank, size, port, timeout=10) as dist:
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        got = torch.empty(2)
        ops = [dist.P2POp(dist.irecv, got, prv), dist.P2POp(dist.isend, torch.full((2,), float(rank)), nxt)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return got.tolist()


@pytest.mark.parametrize("n", [2, *slow(4)])
def test_batch_isend_irecv_ring(ranks, n):
    assert ranks(n, _ring, timeout=60) == [[float((r - 1) % n)] * 2 for r in range(n)]


def _errors(rank, size, port):
    import torch.distributed as dist

    with process_group(rank, size, port):
        with pytest.raises(comm.CommError, match="does not support meta tensors"):
            dist.all_reduce(torch.empty(2, device="meta"))
        # other ranks' outputs may differ in size (uneven all_gather), this rank's must fit its input
        with pytest.raises(comm.CommError, match="the input's 3 elements; got 2 outputs, this rank's of 2"):
            dist.all_gather([torch.empty(2), torch.empty(2)], torch.empty(3))
        with pytest.raises(comm.CommError, match="expected 2 outputs"):
            dist.all_gather([torch.empty(2)], torch.empty(2))
        # the timeout torch gives a group bounds its operations: a rank that stays away fails the other
        quick = dist.new_group(timeout=datetime.timedelta(seconds=2))
        start = time.monotonic()
        if rank == 0:   # torch's error class and wording too, for tools that match them
            with pytest.raises(dist.DistBackendError, match="Timed out") as caught:
                dist.all_reduce(torch.ones(4), group=quick)
            assert isinstance(caught.value, comm.CommTimeout)
            assert time.monotonic() - start < 15
        dist.barrier()  # the world group is unaffected
        # ranks that call different collectives get Mismatch (or a timeout), not a hang
        odd = dist.new_group(timeout=datetime.timedelta(seconds=10))
        with pytest.raises(comm.CommError):
            dist.all_reduce(torch.ones(4 + 4 * rank), group=odd)
        dist.barrier()
        # monitored_barrier names the rank that stayed away
        if rank == 0:
            with pytest.raises(comm.CommTimeout, match=r"ranks \[1\]"):
                dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=1))
        else:
            time.sleep(1.5)
            with pytest.raises(comm.CommTimeout):
                dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=5))
    return True


def test_errors_are_clear_and_bounded(ranks):
    assert ranks(2, _errors) == [True, True]


# ---- DDP against gloo ----------------------------------------------------------------------
def _mlp(unused: bool):
    nn = torch.nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
            self.unused = nn.Linear(4, 4) if unused else None

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    return MLP()


def _ddp(rank, size, port):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    diffs = {}
    with process_group(rank, size, port):
        gloo = dist.new_group(backend="gloo")
        for variant in ["plain", "find_unused", "allreduce_hook", "fp16_hook"]:
            final = []
            for pg in (dist.group.WORLD, gloo):
                torch.manual_seed(0)
                model = _mlp(unused=variant == "find_unused")
                ddp = DDP(model, process_group=pg, find_unused_parameters=variant == "find_unused")
                if variant.endswith("hook"):
                    hook = default_hooks.allreduce_hook if variant == "allreduce_hook" else default_hooks.fp16_compress_hook
                    ddp.register_comm_hook(pg, hook)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
                for step in range(3):
                    g = torch.Generator().manual_seed(100 * step + rank)
                    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                    opt.step()
                final.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            diffs[variant] = (final[0] - final[1]).abs().max().item()
    return diffs


@pytest.mark.parametrize("n", [2, *slow(4)])
def test_ddp_matches_gloo(ranks, n):
    for diffs in ranks(n, _ddp):
        assert diffs["plain"] <= 1e-6 and diffs["find_unused"] <= 1e-6 and diffs["allreduce_hook"] <= 1e-6, diffs
        assert diffs["fp16_hook"] <= 1e-3, diffs


# ---- FSDP2 ---------------------------------------------------------------------------------
def _fsdp2(rank, size, port):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing import assert_close

    with process_group(rank, size, port):
        torch.manual_seed(0)
        ref = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        model = copy.deepcopy(ref)
        mesh = init_device_mesh("cpu", (size,))
        fully_shard(model.linear1, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(2 * size, 5, 16, generator=torch.Generator().manual_seed(step))
            model(x[2 * rank:2 * rank + 2]).pow(2).mean().backward()   # gradients are averaged (AVG)
            ref(x).pow(2).mean().backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=name)
    return True


def test_fsdp2_matches_unsharded(ranks):
    assert ranks(2, _fsdp2) == [True, True]


# ---- tensor parallel on a 2x2 mesh -----------------------------------------------------------
def _tensor_parallel(rank, size, port):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing import assert_close

    nn = torch.nn
    with process_group(rank, size, port):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        model = parallelize_module(copy.deepcopy(ref), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        xs = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
        dp = mesh["dp"].get_local_rank()
        out = model(xs[dp])
        out.pow(2).sum().backward()
        for p in model.parameters():   # data parallel over the other mesh dimension
            dist.all_reduce(p.grad.to_local(), op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        ref_out = ref(xs)
        ref_out.pow(2).sum(dim=(1, 2)).mean().backward()
        assert_close(out, ref_out[dp], rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
    return True


def test_tensor_parallel_2x2_mesh(ranks):
    assert ranks(4, _tensor_parallel) == [True] * 4


# ---- pipeline parallel ---------------------------------------------------------------------
def _pipeline(rank, size, port):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.testing import assert_close

    nn = torch.nn
    with process_group(rank, size, port):
        torch.manual_seed(0)
        full = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss_fn = nn.functional.mse_loss
        loss_fn(full(x), y).backward()
        for schedule in (ScheduleGPipe, Schedule1F1B):
            part = copy.deepcopy(full[:2] if rank == 0 else full[2:])
            part.zero_grad()
            stage = PipelineStage(part, rank, size, torch.device("cpu"))
            sched = schedule(stage, n_microbatches=4, loss_fn=loss_fn)
            if rank == 0:
                sched.step(x)
            else:
                losses = []
                sched.step(target=y, losses=losses)
                assert_close(torch.stack(losses).mean(), loss_fn(full(x), y))
            ref = full[:2] if rank == 0 else full[2:]
            for p, q in zip(part.parameters(), ref.parameters()):
                assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=schedule.__name__)
    return True


def test_pipeline_gpipe_and_1f1b(ranks):
    assert ranks(2, _pipeline) == [True, True]


# ---- torchft ------------------------------------------------------------------------------
def _torchft_reconfigure(rank, size, port):
    """torchft's reconfigurable group on "comm": configure for quorum 1, all_reduce, then
    configure again for quorum 2 (a fresh group over a new store prefix), all_reduce."""
    from torch.distributed import AllreduceOptions, TCPStore

    from comm.torch.torchft import ProcessGroupComm
    store = TCPStore("127.0.0.1", port, size, is_master=rank == 0, wait_for_workers=False)
    pg = ProcessGroupComm(timeout=datetime.timedelta(seconds=30))
    sums = []
    for quorum in (1, 2):
        pg.configure(f"127.0.0.1:{port}/torchft/{quorum}", "replica", rank, size, quorum_id=quorum)
        x = torch.full((4,), float(rank + quorum))
        pg.allreduce([x], AllreduceOptions()).wait()
        sums.append(x.tolist())
    pg.shutdown()
    del store
    return pg.getBackendName(), sums


def test_torchft_process_group_reconfigures(ranks):
    pytest.importorskip("torchft")
    got = ranks(2, _torchft_reconfigure, timeout=120)
    assert got == [("torchft-comm", [[3.0] * 4, [5.0] * 4])] * 2, got
