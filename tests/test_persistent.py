"""Persistent collectives (world.all_reduce_init and friends) and the lean call path.

Results: the conformance suite's own checks run unchanged against a stand-in communicator
whose collectives go through persistent handles, so every collective, dtype and op the suite
covers is compared with the same numpy reference as the one-shot calls. Then reuse, changed
or freed buffers, and failures (abort, dead peer) during wait().
"""
from __future__ import annotations

import importlib.util

import os
import time

import numpy as np
import pytest

import comm
from comm.core.types import DType
from harness import (ENGINE_CHANNELS, Cluster, abort_while_blocked, assert_no_problems, engine_param, engine_setup,
                     slow)
from reference import ALL_DTYPES, dtypes
from test_conformance import (check_all_reduce, check_all_to_all, check_reduce_scatter_all_gather,
                              check_rooted, transport)  # noqa: F401 (the transport fixture)


class Persistently:
    """The collectives of `world` through persistent handles: set up, run (alternately h()
    and start() + wait(), so both paths are covered), closed. Rooted reductions, gather and
    scatter have no persistent form and go to world."""

    def __init__(self, world):
        self._world, self.rank, self.size = world, world.rank, world.size
        self._runs = 0

    def _go(self, h) -> None:
        self._runs += 1
        if self._runs % 2:
            h()
        else:
            h.start()
            h.wait()
        h.close()

    def all_reduce(self, x, op=comm.SUM, *, out=None, scale=None):
        self._go(self._world.all_reduce_init(x, op, out=out, scale=scale))

    def reduce_scatter(self, out, x, op=comm.SUM, *, scale=None):
        self._go(self._world.reduce_scatter_init(out, x, op, scale=scale))

    def all_gather(self, out, x):
        self._go(self._world.all_gather_init(out, x))

    def broadcast(self, x, root=0):
        self._go(self._world.broadcast_init(x, root))

    def all_to_all(self, out, x, out_splits=None, in_splits=None):
        self._go(self._world.all_to_all_init(out, x, out_splits, in_splits))

    def __getattr__(self, name):  # reduce, gather, scatter
        return getattr(self._world, name)


def check_conformance_persistently(world, torch_ok):
    w = Persistently(world)
    problems = check_all_reduce(w, ALL_DTYPES, [0, 1, 1001, 300_001])
    if torch_ok:
        problems += check_all_reduce(w, [DType.BFLOAT16, DType.FLOAT32], [1, 1001], "torch")
    problems += check_reduce_scatter_all_gather(w, ALL_DTYPES, [0, 1, 1001, 70_001])
    problems += check_rooted(w, dtypes(DType.FLOAT32, DType.BFLOAT16, DType.INT64, DType.UINT8), [0, 1, 1001])
    problems += check_all_to_all(w, [DType.FLOAT32, DType.FLOAT16, DType.INT32], 3)
    return problems


def _torch_ok() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("n", [2, *slow(3)])
def test_results_equal_one_shot(cluster, transport, n):  # noqa: F811
    name, launcher = transport
    assert_no_problems(cluster(n, name, launcher).run(check_conformance_persistently, _torch_ok(),
                                                      timeout=300))


def reuse(world, iterations):
    """One handle per collective started `iterations` times, with new data each time."""
    n, r = world.size, world.rank
    x = np.zeros(1000, np.float32)
    ar = world.all_reduce_init(x)
    ag_in, ag_out = np.zeros(7, np.int64), np.zeros(7 * n, np.int64)
    ag = world.all_gather_init(ag_out, ag_in)
    bc = world.broadcast_init(b := np.zeros(3, np.float64), root=n - 1)
    wrong = 0
    for i in range(iterations):
        x[:] = i + r
        ag_in[:] = i * n + r
        b[:] = i if r == n - 1 else -1
        if i % 3 == 0:
            ar.start()
            ar.wait()
        else:
            ar()
        ag()
        bc()
        wrong += int(not (x == n * i + n * (n - 1) / 2).all())
        wrong += int(not (ag_out == np.repeat(i * n + np.arange(n), 7)).all())
        wrong += int(not (b == i).all())
    for h in (ar, ag, bc):
        h.close()
    return wrong


def test_reuse_1000_times(cluster, transport):  # noqa: F811
    name, launcher = transport
    assert cluster(2, name, launcher).run(reuse, 1000, timeout=300) == [0, 0]


def changed_buffers(world):
    """Every way a registered buffer can stop being the caller's memory is refused at start,
    on the rank that changed it, before anything is sent; the communicator stays usable."""
    errors = []

    def refused(h, what):
        try:
            h()
        except comm.InvalidArgument as e:
            errors.append(str(e))
        else:
            errors.append(f"not refused: {what}")

    x = np.zeros(100, np.float32)
    h = world.all_reduce_init(x)
    h()
    x.resize(1000, refcheck=False)       # numpy reallocates: the old memory is freed
    refused(h, "numpy resize")
    y = np.zeros(100, np.float32)
    h = world.all_reduce_init(y)
    y.flags.writeable = False
    refused(h, "read-only now")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        t = torch.zeros(100)
        h = world.all_reduce_init(t)
        t.resize_(10_000)                 # new storage
        refused(h, "torch resize_")
        t = torch.zeros(100)
        h = world.all_reduce_init(t)
        t.set_(torch.zeros(100))          # swapped storage
        refused(h, "torch set_")
        t = torch.zeros(100)
        h = world.all_reduce_init(t)
        t.untyped_storage().resize_(0)    # storage freed under the tensor
        refused(h, "torch storage freed")
    closed = world.all_reduce_init(np.zeros(4))
    closed.close()
    refused(closed, "closed handle")
    started = world.all_reduce_init(z := np.ones(4))
    started.start()
    try:
        started.start()
        errors.append("not refused: a second start")
    except comm.InvalidArgument as e:
        errors.append(str(e))
    started.wait()
    ok = np.ones(4)
    world.all_reduce(ok)                  # still usable
    return errors, float(z[0]), float(ok[0])


def test_changed_buffer_refused(cluster, transport):  # noqa: F811
    name, launcher = transport
    for r, (errors, z0, ok0) in enumerate(cluster(2, name, launcher).run(changed_buffers)):
        assert not [e for e in errors if e.startswith("not refused")], errors
        assert all(f"[rank {r}] all_reduce:" in e for e in errors), errors
        assert any("resized, reallocated or freed" in e for e in errors), errors
        assert any("closed" in e for e in errors) and any("already started" in e for e in errors), errors
        assert z0 == 2.0 and ok0 == 2.0


def _abort_during_wait(world):
    h = world.all_reduce_init(np.ones(10, np.float32))
    if world.rank == 0:  # rank 1 never starts: rank 0 waits until the abort
        h.start()
        return abort_while_blocked(world, h.wait)
    time.sleep(1.5)
    return None


@pytest.mark.parametrize("channels", [engine_param(c, channels=c) for c in ("auto", "ucx")])
def test_abort_during_wait(channels):
    transport, env = engine_setup(channels)
    c = Cluster(2, transport, env={**env, "COMM_TIMEOUT": "30"})
    try:
        kind, seconds = c.run(_abort_during_wait, timeout=60)[0]
    finally:
        c.kill()
    assert kind == "Aborted" and seconds < 2, (kind, seconds)


def _dead_peer_during_wait(world):
    h = world.all_reduce_init(np.ones(1 << 16, np.float32))
    if world.rank == world.size - 1:
        os._exit(3)
    h.start()
    try:
        h.wait()
    except comm.PeerFailure as e:
        try:
            h()
        except comm.CommError as again:
            return "PeerFailure", e.peer, type(again).__name__
    return "no error", None, None


@pytest.mark.parametrize("channels", [engine_param(c, channels=c) for c in ENGINE_CHANNELS])
def test_dead_peer_during_wait(channels):
    transport, env = engine_setup(channels)
    c = Cluster(3, transport, env={**env, "COMM_TIMEOUT": "30"})
    try:
        c.submit(_dead_peer_during_wait)
        out = c.collect([0, 1], timeout=60)
    finally:
        c.kill()
    for rank, (ok, value, waited) in out.items():
        assert ok, value
        assert value == ("PeerFailure", 2, "Aborted"), (rank, value)
        assert waited < 15, f"rank {rank} needed {waited:.1f} s to notice the dead peer"


def lean_errors(world):
    """The lean path's refusals are the full path's: same class, same message."""
    out = []
    for call in (lambda: world.all_reduce(np.zeros(4, np.uint16)),
                 lambda: world.all_reduce(np.zeros((4, 4), np.float32)[:, 0]),
                 lambda: world.all_reduce(np.zeros(4, np.float32), op=comm.BAND),
                 lambda: world.all_reduce(np.zeros(4, np.float32), op=comm.PREMUL_SUM),
                 lambda: world.all_reduce(np.zeros(4), out=np.zeros(5)),
                 lambda: world.all_reduce(np.zeros(4), op="sum"),
                 lambda: world.broadcast(np.zeros(4), root=world.size),
                 lambda: world.broadcast(np.zeros(4), root=True)):
        try:
            call()
            out.append("accepted")
        except comm.InvalidArgument as e:
            out.append(str(e))
    ro = np.zeros(4)
    ro.flags.writeable = False
    try:
        world.all_reduce(ro)
        out.append("accepted")
    except comm.InvalidArgument as e:
        out.append(str(e))
    return out


@pytest.mark.parametrize("channels", [engine_param(c, channels=c) for c in ("auto", "ucx")])
def test_lean_path_errors(cluster, channels):
    transport, env = engine_setup(channels)
    for r, errors in enumerate(cluster(2, transport, env=env).run(lean_errors)):
        assert "accepted" not in errors, errors
        assert all(e.startswith(f"[rank {r}] all_reduce:") or e.startswith(f"[rank {r}] broadcast:")
                   for e in errors), errors
        assert "uint16 is not supported" in errors[0] and "not contiguous" in errors[1], errors
        assert "BAND is not defined for float32" in errors[2] and "needs a factor" in errors[3], errors
        assert "read-only" in errors[-1], errors



# ---- the benchmark's persistent form and decode preset ------------------------------------------

def test_decode_preset_fills_only_flags_not_given():
    from bench import cli
    a = cli.parse_args(["decode"])
    assert (a.minbytes, a.maxbytes, a.stepfactor, a.datatype) == (4096, 256 << 10, 2, DType.BFLOAT16)
    assert a.transports == ["native", "mpi-raw", "gloo"]
    b = cli.parse_args(["decode", "-e", "8K", "--transport=native", "-d", "float"])
    assert (b.minbytes, b.maxbytes, b.datatype, b.transports) == (4096, 8192, DType.FLOAT32, ["native"])


def test_decode_runs_float32_of_the_same_bytes_where_bfloat16_is_missing():
    from bench.benchmarks import Params
    from bench.benchmarks.decode import Decode
    from bench.runners import CommRunner, Runner

    class NoBfloat16(Runner):  # as MPI: no reduction on bfloat16
        def supports(self, bench, dtype, op, in_place):
            return "no bfloat16" if dtype is DType.BFLOAT16 else None

    p = Params(2048, DType.BFLOAT16, comm.SUM, 0, 0, 2)
    q = Decode._as_run(NoBfloat16(), p, True)
    assert (q.dtype, q.count * 4) == (DType.FLOAT32, p.count * 2)
    if importlib.util.find_spec("torch") is not None:   # bfloat16 arrays come from torch
        assert Decode._as_run(CommRunner("native"), p, True) is p


def test_bench_decode_persistent_checks_clean():
    """Two ranks time and check the persistent all_reduce at decode sizes."""
    import subprocess
    import sys
    from harness import ROOT
    env = dict(os.environ, PYTHONPATH=ROOT, COMM_TIMEOUT="60")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "bench", "--np", "2", "decode", "--persistent", "-e", "8K",
                        "--transport", "native", "-n", "3", "-w", "1", "--time-budget", "0.05"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith(" ") and len(line.split()) == 13]
    assert {r[0] for r in rows} == {"4096", "8192"}, p.stdout
    assert all(r[8] == "0" and r[12] == "0" for r in rows), p.stdout
