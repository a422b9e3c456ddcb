"""What the conformance suite does not show about the ucx transport: user messages and
collectives kept apart, async work that does not block the caller, COMM_ALGO, size
mismatches and timeouts as errors, and the reason given when libucx cannot load."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import ROOT, Cluster, assert_no_problems, run_ranks, slow
from reference import dtypes

import comm
from comm.core.types import DType
from transports import base

pytestmark = pytest.mark.skipif(base.unavailable_reason("ucx") is not None,
                                reason=f"ucx: {base.unavailable_reason('ucx')}")


def _run(cluster, n, fn, *args, env=None):
    assert_no_problems(cluster(n, "ucx", "spawn", env).run(fn, *args, timeout=200))


def user_messages_around_collectives(world):
    """A pending irecv (largest user tag) must not hold up collectives posted after it, and
    collective messages must never land in it."""
    problems, r = [], world.rank
    got = np.zeros(64)
    w = world.irecv(got, 1, tag=2**31 - 1) if r == 0 else None
    for i in range(3):
        x = np.full(100 + i, float(r))
        world.all_reduce(x)
        if not (x == 1.0).all():
            problems.append(f"rank {r}: all_reduce {i} disturbed: {x[:3]}")
    if r == 1:
        world.send(np.arange(64.0), 0, tag=2**31 - 1)
    else:
        w.wait()
        if not (got == np.arange(64.0)).all():
            problems.append("rank 0: user message corrupted")
    return problems


def test_user_messages_and_collectives_do_not_mix(cluster):
    _run(cluster, 2, user_messages_around_collectives)


def async_does_not_block(world):
    r = world.rank
    if r == 1:
        time.sleep(0.5)                  # rank 0's all_reduce cannot finish before this
    x = np.ones(1 << 16)
    start = time.monotonic()
    w = world.all_reduce(x, async_op=True)
    posted = time.monotonic() - start
    pending = not w.is_completed()
    w.wait()
    if r == 0 and not (posted < 0.2 and pending):
        return [f"rank 0: async all_reduce took {posted:.3f} s to return (completed: {not pending})"]
    return [] if (x == 2).all() else [f"rank {r}: wrong result {x[0]}"]


def test_async_work_returns_at_once(cluster):
    _run(cluster, 2, async_does_not_block)


@pytest.mark.parametrize("algo", ["ring", *slow("rd", "tree")])
def test_algorithm_override(cluster, algo):
    from test_conformance import check_all_reduce
    _run(cluster, 3, check_all_reduce, dtypes(DType.FLOAT32, DType.BFLOAT16, DType.INT32), [0, 1, 300_001],
         env={"COMM_ALGO": algo, "COMM_CHUNK_BYTES": "65536"})


def mismatched_sizes(world):
    from comm import Mismatch
    if world.rank == 0:
        world.send(np.zeros(10), 1, tag=5)
        return []
    try:
        world.recv(np.zeros(5), 0, tag=5)
    except Mismatch as e:
        return [] if "[rank 1] recv" in str(e) else [f"unclear message: {e}"]
    return ["a too-large message was accepted"]


def test_size_mismatch_is_an_error():
    assert run_ranks(mismatched_sizes, 2, transport="ucx", timeout=60) == [[], []]


def unmatched_recv(world):
    from comm import CommTimeout
    if world.rank == 0:
        try:
            world.irecv(np.zeros(4), 1, tag=9).wait(timeout=0.3)
        except CommTimeout as e:
            return [] if "[rank 0] recv" in str(e) else [f"unclear message: {e}"]
        return ["irecv without a sender completed"]
    return []


def test_wait_honours_the_timeout():
    assert run_ranks(unmatched_recv, 2, transport="ucx", timeout=60) == [[], []]


def test_available_names_the_import_error():
    code = ("import sys; sys.modules['libucx'] = None\n"
            "from transports import base; print(base.unavailable_reason('ucx'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert "the libucx wheel cannot be loaded" in out.stdout, out.stdout + out.stderr


def close_right_after(world, iterations, nbytes):
    """Communicators closed as soon as their last collective returns: a rank that finishes
    first says goodbye while its last fragments still wait in a peer's UCX shared-memory
    queue, which takes that peer several progress calls to drain. Those bytes were
    delivered; the peer must not take the goodbye for a rank that left without them."""
    x = np.ones(nbytes // 4, np.float32)
    for i in range(iterations):
        sub = world.split(0)
        sub.broadcast(x, root=i % world.size)
        sub.all_reduce(x)
        sub.close()
    return []


@pytest.mark.slow
def test_close_right_after_a_collective(cluster):
    _run(cluster, 5, close_right_after, 120, 256 << 10)


def large_payloads(world):
    """Payloads that a receiver on the same host reads out of the sender's buffer (or, refused,
    receives through UCX): send/recv (a header read alone, then its body), broadcast,
    all_reduce, and all_to_all splits that disagree (the offered payload is dropped unread)."""
    problems, r, n = [], world.rank, world.size
    right, left = (r + 1) % n, (r - 1) % n
    for count in (16 << 10, 100_001, 1 << 20):  # 64 KiB to 4 MiB of float32
        x = np.arange(count, dtype=np.float32) * (r + 1)
        got = np.zeros_like(x)
        w = world.isend(x, right, tag=5)
        world.recv(got, left, tag=5)
        w.wait()
        if not (got == np.arange(count, dtype=np.float32) * (left + 1)).all():
            problems.append(f"rank {r}: send/recv of {count} from {left} wrong")
        b = x.copy() if r == 0 else np.zeros_like(x)
        world.broadcast(b, root=0)
        if not (b == np.arange(count, dtype=np.float32)).all():
            problems.append(f"rank {r}: broadcast of {count} wrong")
        a = np.ones(count, np.float32) * (r + 1)
        world.all_reduce(a)
        if not (a == n * (n + 1) / 2).all():
            problems.append(f"rank {r}: all_reduce of {count} wrong")
    # rank 0 sends 64 Ki elements to each peer, which expect 32 Ki: the peers report the
    # disagreement after the exchange ran to its end (rank 0's offers dropped unread). On a
    # communicator of its own: the failure leaves it unusable, and `world` is the session's.
    block = 1 << 16
    mine = [block] * n if r == 0 else [block // 2] * n
    expect = [block] + [block // 2] * (n - 1) if r == 0 else [block // 2] * n
    sub = world.split(0)
    try:
        sub.all_to_all(np.zeros(sum(expect), np.float32), np.ones(sum(mine), np.float32), expect, mine)
        if r != 0:
            problems.append(f"rank {r}: disagreeing splits were not reported")
    except comm.Mismatch:
        pass
    sub.close()
    world.barrier()  # the session's communicator still works
    return problems


def test_large_payloads_on_one_host(cluster):
    _run(cluster, 3, large_payloads)


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root, to start a rank in a pid namespace of its own")
def test_reads_refused_across_pid_namespaces():
    """A rank in another pid namespace (a container on the same host) names a pid that means
    another process here: the receiver must find out (the cookie does not read back) and take
    the payload through UCX, never read whatever that pid holds."""
    c = Cluster(2, "ucx", wrap=[[], ["unshare", "--pid", "--fork"]], timeout=60)
    try:
        assert_no_problems(c.run(large_payloads, timeout=120))
        pids = c.run(_pid)
        assert pids[1] == 1, f"rank 1 did not run in a pid namespace of its own (pid {pids[1]})"
    finally:
        c.close()


def _pid(world):
    return os.getpid()
