"""The multi-rank parts of the device check: module-level functions the test harness runs on
rank processes (fn(rank, size) when the harness does not call comm.init). Both ranks share the
machine's one GPU, which is what the staged path allows and NCCL refuses."""
from __future__ import annotations

import time


def _torch_group(rank: int, size: int):
    import torch
    import torch.distributed as dist

    import comm.torch  # noqa: F401  (registers "comm")
    torch.cuda.set_device(0)
    dist.init_process_group("comm", rank=rank, world_size=size)
    return torch, dist


def _staged_notice() -> list[str]:
    """The notices saying CUDA tensors took the staged path (printed once per process)."""
    from comm.core import gpu
    return [n for n in gpu._noticed if "pinned host memory over the" in n]


def nccl_shared_gpu(rank: int, size: int) -> tuple[str, float]:
    """Two ranks on one GPU ask for nccl: every rank gets TransportUnavailable naming the shared
    GPU, before anyone enters ncclCommInitRank (which would hang or fail on one rank only)."""
    import comm
    t0 = time.monotonic()
    try:
        comm.init(transport="nccl", timeout=60).close()
    except comm.TransportUnavailable as e:
        return str(e), time.monotonic() - t0
    raise AssertionError("nccl accepted two ranks on one GPU")


def comm_staged(world) -> None:
    """comm's own API on CUDA tensors over the native transport (staged), two ranks."""
    import torch
    torch.cuda.set_device(0)
    r, n = world.rank, world.size
    x = torch.full((1000,), float(r + 1), device="cuda")
    world.all_reduce(x)
    assert torch.all(x == n * (n + 1) / 2).item(), x[:4]
    y = torch.arange(10, dtype=torch.float32, device="cuda") + r
    out = torch.empty_like(y)
    world.all_reduce(y, out=out, op=__import__("comm").MAX)
    assert torch.equal(out.cpu(), torch.arange(10, dtype=torch.float32) + n - 1)
    assert torch.equal(y.cpu(), torch.arange(10, dtype=torch.float32) + r)     # input untouched
    gathered = torch.zeros(4 * n, device="cuda", dtype=torch.bfloat16)
    gathered[4 * r:4 * r + 4] = r
    world.all_gather(gathered, gathered[4 * r:4 * r + 4])                       # in place
    assert torch.equal(gathered.cpu(), torch.arange(n).repeat_interleave(4).to(torch.bfloat16))
    rs = torch.empty(3, device="cuda")
    world.reduce_scatter(rs, torch.ones(3 * n, device="cuda"))
    assert torch.all(rs == n).item()
    b = torch.full((5,), float(r), device="cuda")
    world.broadcast(b, root=1)
    assert torch.all(b == 1).item()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):                       # staged copies follow the current stream
        z = torch.ones(1 << 20, device="cuda") * (r + 1)
        work = world.all_reduce(z, async_op=True)
        work.wait()
        assert float(z.sum()) == n * (n + 1) / 2 * (1 << 20)
    if r == 0:
        world.send(torch.arange(6, device="cuda"), 1, tag=3)
    else:
        got = torch.zeros(6, dtype=torch.int64, device="cuda")
        world.recv(got, 0, tag=3)
        assert torch.equal(got.cpu(), torch.arange(6))


def torch_staged(rank: int, size: int) -> list[str]:
    """The torch backend with CUDA tensors at world size 2 on one GPU: the ranks agree on the
    staged path and every collective is right, futures included."""
    torch, dist = _torch_group(rank, size)
    try:
        x = torch.full((64,), float(rank + 1), device="cuda")
        dist.all_reduce(x)
        assert torch.all(x == 3).item()
        parts = [torch.empty(8, device="cuda") for _ in range(size)]
        dist.all_gather(parts, torch.full((8,), float(rank), device="cuda"))
        assert all(torch.all(p == i).item() for i, p in enumerate(parts))
        b = torch.full((4,), float(rank), device="cuda")
        dist.broadcast(b, src=1)
        assert torch.all(b == 1).item()
        work = dist.all_reduce(torch.ones(16, device="cuda"), async_op=True)
        value = work.get_future().wait()
        assert torch.all(value[0] == 2).item() and value[0].is_cuda
        t = torch.empty(8, 2, device="cuda").t()               # non-contiguous output
        t.fill_(rank + 1)
        dist.all_reduce(t)
        assert torch.all(t == 3).item()
        dist.barrier()
        return _staged_notice()
    finally:
        dist.destroy_process_group()


def ddp_staged(rank: int, size: int) -> float:
    """DDP on CUDA at two ranks over the staged path: after backward every rank holds the
    average of both ranks' gradients (computed here for both), and parameters stay equal."""
    torch, dist = _torch_group(rank, size)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
        reference = [p.detach().clone() for p in model.parameters()]
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.01)     # several buckets
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

        def batch(r, step):
            g = torch.Generator().manual_seed(100 * step + r)
            return torch.randn(16, 32, generator=g).cuda(), torch.randn(16, 4, generator=g).cuda()

        for step in range(3):
            want = []
            for r in range(size):                              # every rank's local gradient
                local = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
                with torch.no_grad():
                    for p, q in zip(local.parameters(), model.parameters()):
                        p.copy_(q)
                xb, yb = batch(r, step)
                torch.nn.functional.mse_loss(local(xb), yb).backward()
                want.append([p.grad for p in local.parameters()])
            xb, yb = batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(xb), yb).backward()
            for p, *grads in zip(model.parameters(), *want):
                assert torch.allclose(p.grad, sum(grads) / size, atol=1e-5), "gradient is not the average"
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        hi, lo = flat.clone(), flat.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        assert torch.equal(hi, lo), "parameters differ between ranks"
        moved = sum(float((p.detach() - q).abs().sum()) for p, q in zip(model.parameters(), reference))
        assert moved > 0
        return moved
    finally:
        dist.destroy_process_group()


def window_staged(world, allocated: bool) -> tuple[list[str], str]:
    """One-sided windows with CUDA sources and destinations (staged through pinned host
    memory), two ranks on the one GPU: puts from CUDA tensors with signals, many in flight,
    one produced on a side stream; gets into CUDA tensors completed by flush, fence and close;
    every byte checked on the GPU. The window is host memory: pinned (torch), or the library's
    (allocated). A CUDA window is refused on both ranks when one rank passes it."""
    import numpy as np
    import torch

    import comm
    torch.cuda.set_device(0)
    r, peer = world.rank, 1 - world.rank
    block, blocks = 64 << 10, 24

    def pattern(rank: int, i: int):
        return ((torch.arange(block, device="cuda", dtype=torch.int64) * 7 + 31 * rank + i) % 251).to(torch.uint8)

    try:
        world.window(torch.zeros(64, dtype=torch.uint8, device="cuda") if r == 1 else np.zeros(64, np.uint8))
        raise AssertionError("a CUDA window was made")
    except comm.InvalidArgument as e:
        assert ("windows expose host memory" in str(e)) if r == 1 else ("rank 1 refused" in str(e)), e
    size = block * blocks + 4096                              # the blocks, then the side stream's put
    w = world.window(size if allocated else torch.zeros(size, dtype=torch.uint8, pin_memory=True), signals=4)
    mem = torch.from_numpy(w.buffer) if allocated else w.buffer
    for i in range(blocks):                                   # many in flight, a signal each
        w.put(peer, pattern(r, i), i * block, signal=1)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):                             # staging follows the current stream:
        late = pattern(r, 99) * 1                             # produced by a kernel on `side`, not
        w.put(peer, late[:4096], size - 4096, signal=2)       # synchronised by the caller
    w.wait_signal(1, blocks)
    w.wait_signal(2, 1)
    got = mem.cuda()
    for i in range(blocks):
        assert torch.equal(got[i * block:(i + 1) * block], pattern(peer, i)), f"put block {i}"
    assert torch.equal(got[size - 4096:], pattern(peer, 99)[:4096]), "put from the side stream"
    w.flush()
    world.barrier()
    dst = torch.zeros(2 * block, dtype=torch.uint8, device="cuda")
    w.get(peer, dst, 3 * block)                               # peer's window holds my blocks
    w.flush(peer)
    assert torch.equal(dst, torch.cat([pattern(r, 3), pattern(r, 4)])), "get completed by flush"
    with torch.cuda.stream(side):
        by_fence = torch.zeros(block, dtype=torch.uint8, device="cuda")
        w.get(peer, by_fence, 5 * block)
    w.fence()
    assert torch.equal(by_fence, pattern(r, 5)), "get completed by fence (read on another stream)"
    by_close = torch.zeros(block, dtype=torch.uint8, device="cuda")
    w.get(peer, by_close, 6 * block)
    path = w._tw.paths[peer]
    w.close()
    assert torch.equal(by_close, pattern(r, 6)), "get completed by close"
    from comm.core import gpu
    return [n for n in gpu._noticed if "windows are staged" in n], path
