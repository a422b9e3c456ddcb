"""One-sided windows on the mpi transport (MPI-3 RMA, signals emulated with a counter window):
put / get / signals at edge offsets and sizes, windows of different sizes (0 bytes too), many
puts in flight to every peer from every origin into disjoint ranges, the refusals of bad
input, and a wait that times out. Ranks are launched by a real mpirun."""
from __future__ import annotations

import time

import numpy as np
import pytest
from harness import assert_no_problems, slow
from reference import HAVE_TORCH

from transports import base

pytestmark = pytest.mark.skipif(base.unavailable_reason("mpi") is not None,
                                reason=f"mpi: {base.unavailable_reason('mpi')}")

N = 3


def _size(rank: int) -> int:
    """Every rank's window size: uneven, and rank 0's is empty."""
    return (0, 4099, 1000)[rank] if rank < 3 else 777


def _pattern(origin: int, nbytes: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(nbytes) * 7 + origin * 31 + salt) % 251).astype(np.uint8)


def edges(world):
    """Rank 0 puts at the first and last byte, whole windows, 1-byte and 0-byte puts, into a
    numpy window and (with torch) a tensor window; gets them back; the target checks
    with a model of what its window must hold."""
    problems, r = [], world.rank
    mem = np.full(_size(r), 0xEE, np.uint8)
    with world.window(mem, signals=4) as w:
        if w.sizes != tuple(_size(q) for q in range(world.size)):
            problems.append(f"rank {r}: sizes {w.sizes}")
        model = {q: np.full(_size(q), 0xEE, np.uint8) for q in range(world.size)}
        if r == 0:
            cases = [(1, 0, 1), (1, 4098, 1), (1, 17, 0), (1, 0, 4099), (1, 100, 333), (2, 0, 0)]
            for salt, (peer, off, n) in enumerate(cases):
                src = _pattern(0, n, salt)
                w.put(peer, src, off)
                model[peer][off:off + n] = src
            w.put(1, np.zeros(0, np.uint8), 0, signal=3)   # a pure notification, after the data
            w.flush()
            back = np.zeros(4099, np.uint8)
            w.get(1, back, 0)
            part = np.zeros(5, np.uint8)
            w.get(1, part, 4094)
            w.flush(1)
            if not (back == model[1]).all() or not (part == model[1][4094:]).all():
                problems.append("rank 0: get did not return what was put")
        if r == 1:
            w.wait_signal(3, 1, timeout=30)
            if w.signal(3) != 1 or w.signal(0) != 0:
                problems.append(f"rank 1: counters {w.signal(3)}, {w.signal(0)}")
        w.fence()
        want = model[r] if r != 1 else _rank1_model()
        if not (mem == want).all():
            problems.append(f"rank {r}: window holds {np.flatnonzero(mem != want)[:5]} wrong bytes")
    return problems


def _rank1_model() -> np.ndarray:
    m = np.full(4099, 0xEE, np.uint8)
    for salt, (off, n) in enumerate([(0, 1), (4098, 1), (17, 0), (0, 4099), (100, 333)]):
        m[off:off + n] = _pattern(0, n, salt)
    return m


def many_in_flight(world, rounds):
    """Every rank puts `rounds` blocks to every rank (itself too) into the origin's own slice
    of the target's window, with a signal per block; each target waits for all its signals,
    then checks every byte; then every rank gets its slice back from every peer."""
    problems, r, n = [], world.rank, world.size
    block = 64
    mem = np.zeros(n * rounds * block, np.uint8)
    with world.window(mem, signals=n) as w:
        for i in range(rounds):
            for peer in range(n):
                w.put(peer, _pattern(r, block, i + peer), (r * rounds + i) * block, signal=r)
        for origin in range(n):
            w.wait_signal(origin, rounds, timeout=60)
        for origin in range(n):
            for i in range(rounds):
                at = (origin * rounds + i) * block
                if not (mem[at:at + block] == _pattern(origin, block, i + r)).all():
                    problems.append(f"rank {r}: block {i} from rank {origin} is wrong")
        back = np.zeros((n, rounds * block), np.uint8)
        for peer in range(n):
            w.get(peer, back[peer], r * rounds * block)
        w.flush()
        for peer in range(n):
            want = np.concatenate([_pattern(r, block, i + peer) for i in range(rounds)])
            if not (back[peer] == want).all():
                problems.append(f"rank {r}: get from rank {peer} is wrong")
    return problems


def refusals(world):
    """Bad input is InvalidArgument naming rank and op, before anything moves; a wait for a
    signal nobody sends times out within its timeout and leaves the communicator usable; a
    closed window is refused."""
    import comm
    problems, r = [], world.rank
    mem = np.zeros(_size(r), np.uint8)
    w = world.window(mem, signals=2)
    bad = [("put", lambda: w.put(1, np.zeros(8, np.uint8), 4092)),        # one byte past the end
           ("put", lambda: w.put(2, np.zeros(1, np.uint8), 1000)),        # at the end of rank 2's
           ("put", lambda: w.put(world.size, np.zeros(1, np.uint8))),     # no such rank
           ("put", lambda: w.put(1, np.zeros(1, np.uint8), -1)),
           ("put", lambda: w.put(1, np.zeros(1, np.uint8), 0, signal=2)),  # signals 0 and 1 only
           ("put", lambda: w.put(0, np.zeros(1, np.uint8), 0)),           # rank 0's window is empty
           ("get", lambda: w.get(0, np.zeros(1, np.uint8), 0)),           # rank 0's window is empty
           ("wait_signal", lambda: w.wait_signal(5, 1))]
    for i, (op, call) in enumerate(bad):
        try:
            call()
            problems.append(f"rank {r}: {op} accepted bad input (case {i})")
        except comm.InvalidArgument as e:
            if f"[rank {r}] {op}" not in str(e):
                problems.append(f"rank {r}: message does not name rank and op: {e}")
    start = time.monotonic()
    try:
        w.wait_signal(0, 1, timeout=0.3)
        problems.append(f"rank {r}: wait_signal for a signal nobody sends returned")
    except comm.CommTimeout as e:
        took = time.monotonic() - start
        if not 0.3 <= took < 3 or "wait_signal" not in str(e):
            problems.append(f"rank {r}: timeout after {took:.2f} s: {e}")
    w.fence()                      # still usable after the refusals and the timeout
    if w.signal(0) != 0:
        problems.append(f"rank {r}: a refused put moved a counter")
    w.close()
    try:
        w.put(0, np.zeros(0, np.uint8))
        problems.append(f"rank {r}: put on a closed window was accepted")
    except comm.CommError:
        pass
    x = np.ones(4)
    world.all_reduce(x)
    return problems + ([] if x[0] == world.size else [f"rank {r}: all_reduce after close: {x}"])


def tensor_window(world):
    """A window over a torch tensor (a paged pool's shape), put by row."""
    import torch
    problems, r = [], world.rank
    pool = torch.zeros(8, 16, dtype=torch.bfloat16)
    with world.window(pool, signals=1) as w:
        if r == 0:
            row = torch.arange(16, dtype=torch.bfloat16)
            w.put(1, row, 5 * 16 * 2, signal=0)
        if r == 1:
            w.wait_signal(0, 1, timeout=30)
            if not torch.equal(pool[5], torch.arange(16, dtype=torch.bfloat16)) or pool[4].any():
                problems.append(f"rank 1: pool row 5 is {pool[5].tolist()}")
    return problems


# Open MPI's osc/ucx on shared memory and TCP too (it serves RDMA devices only by default): the
# osc with passive progress, whose accumulates a polling target once starved
OSC_UCX = {"OMPI_MCA_osc": "ucx", "OMPI_MCA_opal_common_ucx_tls": "any", "OMPI_MCA_opal_common_ucx_devices": "any"}


@pytest.mark.parametrize("env", [None, *slow(OSC_UCX)], ids=["default-osc", "osc-ucx"])
def test_put_get_signals_at_edges(cluster, env):
    c = cluster(N, "mpi", "mpirun", env)
    assert_no_problems(c.run(edges, timeout=120))
    assert_no_problems(c.run(many_in_flight, 20, timeout=120))
    assert_no_problems(c.run(refusals, timeout=120))
    if HAVE_TORCH:
        assert_no_problems(c.run(tensor_window, timeout=120))
