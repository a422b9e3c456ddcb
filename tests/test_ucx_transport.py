"""What the conformance suite does not show about the ucx transport: user messages and
collectives kept apart, async work that does not block the caller, COMM_ALGO, size
mismatches and timeouts as errors, and the reason given when libucx cannot load."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from harness import ROOT, assert_no_problems, run_ranks
from reference import dtypes

from comm.types import DType
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


@pytest.mark.parametrize("algo", ["ring", "rd", "tree"])
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
