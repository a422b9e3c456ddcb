"""Real faults: a killed peer, a stopped peer, a cut link,
mismatched collectives. Every survivor gets the right error within its timeout, never a hang,
and nothing is left behind in /dev/shm."""
from __future__ import annotations

import glob
import os
import signal
import time

import numpy as np
import pytest

import comm
from harness import ENGINE_CHANNELS, Cluster, engine_param, engine_setup, slow
from bench.cluster import NetnsCluster, unavailable
from reference import dtypes as dtypes_here
from transports import base

pytestmark = pytest.mark.skipif(base.unavailable_reason("native") is not None,
                                reason=f"native: {base.unavailable_reason('native')}")
TIMEOUT = 8.0


def shm_segments() -> set[str]:
    return set(glob.glob("/dev/shm/comm*"))


def busy_loop(world, seconds):
    """All ranks all_reduce 4 MiB repeatedly; returns the error type, cause and peer, if any."""
    x = np.ones(1 << 20, np.float32)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            world.all_reduce(x)
            x[:] = 1
    except comm.CommError as e:
        after = None
        try:
            world.all_reduce(x)
        except comm.CommError as again:
            after = type(again).__name__
        return type(e).__name__, str(e), getattr(e, "peer", None), after
    return None


def pid(world):
    return os.getpid()


def _fault(n, victim, sig, channels="auto", timeout=TIMEOUT):
    segments = shm_segments()
    transport, env = engine_setup(channels)
    c = Cluster(n, transport, env=dict({"COMM_TIMEOUT": str(timeout)}, **env))
    try:
        pids = c.run(pid)
        c.submit(busy_loop, 60)
        time.sleep(1.5)
        os.kill(pids[victim], sig)
        t0 = time.monotonic()
        survivors = [r for r in range(n) if r != victim]
        results = c.collect(survivors, timeout + 10)
        if sig == signal.SIGSTOP:
            os.kill(pids[victim], signal.SIGCONT)
        return results, time.monotonic() - t0, segments
    finally:
        c.kill()


@pytest.mark.parametrize("channels", [engine_param(c, channels=c) for c in ENGINE_CHANNELS])
@pytest.mark.parametrize("n", [2, *slow(3, 4)])
def test_peer_killed(n, channels):
    victim = n - 1
    results, _, before = _fault(n, victim, signal.SIGKILL, channels)
    for r, (ok, value, seconds) in results.items():
        assert ok and value is not None, f"rank {r}: {value}"
        kind, text, peer, after = value
        assert kind == "PeerFailure", f"rank {r}: {text}"
        assert f"[rank {r}]" in text and f"rank {victim}" in text, text
        assert seconds < TIMEOUT + 2, f"rank {r} took {seconds:.1f} s to notice"
        assert after == "Aborted", f"rank {r}: after the failure a new op gave {after}"
    time.sleep(0.5)
    assert shm_segments() <= before, f"left in /dev/shm: {shm_segments() - before}"


@pytest.mark.parametrize("channels", [engine_param("auto", channels="auto"),
                                      engine_param("ucx", channels="ucx", slow=True)])
@pytest.mark.parametrize("n", [2, *slow(3)])
def test_peer_stopped(n, channels):
    # a stopped peer is found by the timeout alone: a short one (the test waits it out)
    timeout = 4.0
    results, _, _ = _fault(n, 0, signal.SIGSTOP, channels, timeout)
    for r, (ok, value, seconds) in results.items():
        assert ok and value is not None, f"rank {r}: {value}"
        kind, text, _, _ = value
        assert kind == "CommTimeout", f"rank {r}: {text}"
        assert seconds < timeout + 2, f"rank {r} took {seconds:.1f} s"


def mismatched(world, case):
    x = np.ones(64, np.float32)
    try:
        if case == "count":
            world.all_reduce(np.ones(64 if world.rank == 0 else 65, np.float32))
        elif case == "op":
            world.all_reduce(x, op=comm.SUM if world.rank == 0 else comm.MAX)
        elif case == "dtype":
            world.all_reduce(x if world.rank == 0 else np.ones(64, np.float64))
        elif case == "root":
            world.broadcast(x, root=world.rank)
        elif case == "collective":
            world.all_reduce(x) if world.rank == 0 else world.all_gather(np.ones(128, np.float32), x)
        elif case == "skipped":
            if world.rank == 0:
                world.all_reduce(x)
            world.barrier()
    except comm.CommError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("case", ["count", "op", "dtype", "root", "collective", "skipped"])
def test_mismatch_detected(case):
    c = Cluster(2, env={"COMM_TIMEOUT": str(TIMEOUT)})
    try:
        results = c.run(mismatched, case, timeout=TIMEOUT + 10)
    finally:
        c.kill()
    for r, got in enumerate(results):
        assert got is not None, f"rank {r}: mismatched '{case}' was not detected"
        kind, text = got
        assert kind in ("Mismatch", "CommTimeout"), f"rank {r}: {text}"
        if kind == "Mismatch":   # names the other rank and what each side called
            assert f"rank {1 - r} sent " in text and "but this rank expected" in text, text
    assert any(kind == "Mismatch" for kind, _ in results), results


def stalled(world, path):
    if world.rank == 0:
        world.all_reduce(np.ones(8))
        try:
            world.broadcast(np.ones(8), root=1)     # rank 1 never comes
        except comm.CommTimeout as e:
            return str(e)
    else:
        world.all_reduce(np.ones(8))
        time.sleep(6)
    return None


@pytest.mark.slow
def test_flight_recorder_dump(tmp_path):
    path = tmp_path / "flight.txt"
    c = Cluster(2, env={"COMM_TIMEOUT": "2", "COMM_FLIGHT_RECORDER": str(path)})
    try:
        text = c.run(stalled, str(path), timeout=30)[0]
    finally:
        c.kill()
    assert text and "[rank 0] broadcast" in text
    dump = path.read_text()
    assert "rank 0" in dump and "broadcast" in dump and "failed" in dump and "all_reduce" in dump


@pytest.mark.slow
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_link_cut_between_hosts():
    hosts = NetnsCluster(2)
    try:
        c = Cluster(2, env={"MASTER_ADDR": hosts.addr(0), "COMM_TIMEOUT": str(TIMEOUT)}, netns=hosts.ns)
        try:
            c.submit(busy_loop, 60)
            time.sleep(1.5)
            hosts.cut(0)
            results = c.collect([0, 1], TIMEOUT + 10)
        finally:
            c.kill()
    finally:
        hosts.close()
    for r, (ok, value, seconds) in results.items():
        assert ok and value is not None, f"rank {r}: {value}"
        assert value[0] in ("CommTimeout", "PeerFailure"), value
        assert seconds < TIMEOUT + 2, f"rank {r} took {seconds:.1f} s"


def soak(world, iterations, seed):
    """Random collectives on random data, checked against numpy; returns (wrong, fds, rss)."""
    from reference import make, mismatch, reduce, values
    from comm.core.types import DType, ReduceOp
    rng = np.random.default_rng(seed)            # same sequence on every rank
    halves = world.split(world.rank % 2)
    fds0 = len(os.listdir("/proc/self/fd"))
    wrong, rss = [], []
    dtypes = dtypes_here(DType.FLOAT32, DType.FLOAT64, DType.INT32, DType.BFLOAT16, DType.UINT8)
    for i in range(iterations):
        kind = rng.integers(0, 4)
        dtype = dtypes[rng.integers(0, len(dtypes))]
        count = int(rng.integers(0, 3000))
        group = halves if rng.integers(0, 4) == 0 else world
        g = group.rank
        ins = [values(dtype, count, q, i) for q in range(group.size)]
        x = make(ins[g], dtype)
        if kind == 0:
            op = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN][rng.integers(0, 3)]
            group.all_reduce(x, op=op)
            p = mismatch(x, reduce(ins, op, dtype), dtype, f"op {i} all_reduce")
        elif kind == 1:
            root = int(rng.integers(0, group.size))
            group.broadcast(x, root=root)
            p = mismatch(x, ins[root], dtype, f"op {i} broadcast")
        elif kind == 2:
            out = make(np.zeros(count * group.size), dtype)
            group.all_gather(out, x)
            p = mismatch(out, np.concatenate(ins), dtype, f"op {i} all_gather")
        else:
            root = int(rng.integers(0, group.size))
            group.reduce(x, root=root)
            p = mismatch(x, reduce(ins, ReduceOp.SUM, dtype) if g == root else ins[g], dtype, f"op {i} reduce")
        if p:
            wrong.append(p)
        if i % 1000 == 0:
            with open("/proc/self/statm") as f:
                rss.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    halves.close()
    return wrong, len(os.listdir("/proc/self/fd")) - fds0, rss


@pytest.mark.slow
@pytest.mark.parametrize("channels", [engine_param(c, channels=c) for c in ("auto", "ucx")])
def test_soak_random_collectives(channels):
    before = shm_segments()
    transport, env = engine_setup(channels)
    c = Cluster(4, transport, env=env)
    try:
        results = c.run(soak, 10_000, 1234, timeout=900)
    finally:
        c.close()
    for r, (wrong, fd_growth, rss) in enumerate(results):
        assert not wrong, f"rank {r}: {wrong[:5]}"
        assert fd_growth <= 0, f"rank {r}: {fd_growth} more open fds after the soak"
        assert rss[-1] - rss[1] < 32 << 20, f"rank {r}: RSS grew {(rss[-1] - rss[1]) >> 20} MiB"
    assert shm_segments() <= before


def test_flight_recorder_on_stderr_shows_the_last_entries(capsys, monkeypatch):
    """Every survivor of a failure dumps: on stderr only the last SHOWN entries of each list,
    and where the rest can be kept."""
    from comm.flight_recorder import SHOWN, FlightRecorder
    from comm.core.ops import OpKind
    from comm.core.types import DType
    monkeypatch.delenv("COMM_FLIGHT_RECORDER", raising=False)
    engine = [(i, int(OpKind.ALL_REDUCE), int(DType.FLOAT32), 4, 0, "done", 0.0) for i in range(1, 41)]
    text = FlightRecorder(0, "world", lambda: engine).dump("a peer died")
    assert capsys.readouterr().err == text
    rows = [line for line in text.splitlines() if line.strip().split(" ")[0].isdigit()]
    assert [int(r.split()[0]) for r in rows] == list(range(41 - SHOWN, 41)), text
    assert f"... {40 - SHOWN} earlier (COMM_FLIGHT_RECORDER=<file> keeps them all)" in text
