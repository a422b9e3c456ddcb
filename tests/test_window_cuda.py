"""CUDA buffers and one-sided windows (comm.window, comm.staging.WindowStaging).

A window's memory is host memory: a CUDA window is refused, on every rank at once when only one
rank passes one. Puts from and gets into CUDA buffers are staged through pinned host memory;
what needs no GPU runs here: the refusals, the order of the checks (bad input is InvalidArgument
before staging is even tried), a clear TransportUnavailable where this process cannot run
CUDA, the lean path passing CUDA buffers by, and the window and communicator working on after
all of it. "A CUDA buffer" here is a CUDA-array-interface or DLPack producer that says its
memory is on CUDA (tests/test_staging.py); the staged copies themselves run in
tests/device/run.py on a GPU machine."""
from __future__ import annotations

import time

import numpy as np
import pytest

import comm
from comm.core import gpu
from harness import slow
from test_staging import GPU_REASON, CudaArray, DLPackProducer

SETUPS = {"cma": {}, "tcp": {"COMM_CHANNELS": "tcp"}, "shm": {"COMM_CMA": "0"}}
NO_GPU = pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present: tests/device/run.py stages for real")


def _cluster(cluster, name, n=2):
    # the same set-ups (and so the same reused clusters) as tests/test_window.py
    return cluster(n, "native", env=dict(SETUPS[name], COMM_TIMEOUT="20"))


# ---- a CUDA window: refused on every rank alike -----------------------------------------------------

def _cuda_window_on(world, cuda_ranks):
    """The ranks in cuda_ranks pass a CUDA array as their window, the others host memory:
    every rank gets InvalidArgument at once (none waits in the exchange), the CUDA ranks with
    the why and what to do; then the communicator still makes a window and reduces."""
    mine = CudaArray(16) if world.rank in cuda_ranks else np.zeros(64, np.uint8)
    t0 = time.monotonic()
    try:
        world.window(mine)
    except comm.InvalidArgument as e:
        message, took = str(e), time.monotonic() - t0
    else:
        return "made"
    with world.window(np.zeros(8, np.uint8)) as w:
        w.put(1 - world.rank, np.full(8, 3, np.uint8))
        w.fence()
        landed = bool((w.buffer == 3).all())
    x = np.ones(4)
    world.all_reduce(x)
    return message, took < 10, landed, float(x[0])


@pytest.mark.parametrize("cuda_ranks", [(1,), pytest.param((0, 1), marks=pytest.mark.slow)])
def test_cuda_window_refused_on_every_rank(cluster, cuda_ranks):
    got = _cluster(cluster, "cma").run(_cuda_window_on, cuda_ranks)
    for rank, (message, quick, landed, total) in enumerate(got):
        assert quick and landed and total == 2.0, got
        assert f"[rank {rank}] window:" in message
        if rank in cuda_ranks:
            assert "the window is on cuda; windows expose host memory" in message
            assert "pin_memory=True" in message and "c.window(nbytes)" in message
            assert "put from / get into CUDA buffers" in message
        else:
            assert f"rank {cuda_ranks[0]} refused its arguments" in message


# ---- CUDA sources and destinations without a GPU ----------------------------------------------------

def _cuda_buffers_without_gpu(world):
    """Bad input with a CUDA buffer is InvalidArgument (sized by the CUDA buffer); good input
    is TransportUnavailable naming put / get and why; a producer whose memory is really host
    memory but says CUDA is not taken by the lean path (it would move its bytes); nothing
    lands in the peer's window, and window and communicator work on."""
    peer = 1 - world.rank
    buf = np.full(64, 9, np.uint8)
    w = world.window(buf, signals=2)
    seen = []

    def attempt(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except comm.CommError as e:
            seen.append((type(e).__name__, str(e)))
        else:
            seen.append(("moved", ""))

    attempt(w.put, peer, CudaArray(17))                     # 68 bytes: larger than the window
    attempt(w.put, peer, CudaArray(4), 52)                  # 16 bytes at 52: past the end
    attempt(w.put, peer, CudaArray(4), signal=2)            # no such signal
    attempt(w.get, peer, CudaArray(2), 57)                  # 8 bytes at 57: past the end
    attempt(w.put, peer, CudaArray(4), 48, signal=1)        # good input: staging cannot run here
    attempt(w.get, peer, CudaArray(16))
    attempt(w.put, peer, DLPackProducer(np.full(16, 1, np.uint8)))
    attempt(w.get, peer, DLPackProducer(np.zeros(16, np.uint8)))
    w.flush()
    w.fence()
    untouched = bool((buf == 9).all())
    world.barrier()   # before the peer's put below lands here
    w.put(peer, np.full(4, world.rank + 1, np.uint8), 60, signal=0)
    w.flush()
    w.wait_signal(0, 1)
    put_after = int(buf[60])
    w.close()
    x = np.ones(4)
    world.all_reduce(x)
    return seen, untouched, put_after, float(x[0])


@NO_GPU
@pytest.mark.parametrize("name", ["cma", "tcp", *slow("shm")])
def test_cuda_src_and_dst_without_gpu(cluster, name):
    got = _cluster(cluster, name).run(_cuda_buffers_without_gpu)
    for rank, (seen, untouched, put_after, total) in enumerate(got):
        assert untouched and put_after == 2 - rank and total == 2.0, got
        kinds = [kind for kind, _ in seen]
        assert kinds == ["InvalidArgument"] * 4 + ["TransportUnavailable"] * 4, seen
        assert "68 bytes at offset 0 do not fit" in seen[0][1] and "16 bytes at offset 52" in seen[1][1]
        assert "signal 2 is out of range" in seen[2][1] and "8 bytes at offset 57" in seen[3][1]
        for (_, message), op, what in zip(seen[4:], ["put", "get"] * 2, ["src", "dst"] * 2):
            assert message.startswith(f"[rank {rank}] {op}: {what} is a CUDA buffer, which windows stage "
                                      "through pinned host memory: "), message
            if gpu._cudart is None:   # as here: the ranks run this Python
                assert message.endswith(gpu.NO_BINDINGS), message
            else:
                assert "no device" in message or "cannot start" in message, message
