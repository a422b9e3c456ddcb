"""Ranks on several hosts: network namespaces joined by a bridge (bench.cluster), shared
memory inside each host, TCP across. The conformance checks on block, one-per-host, uneven and
cyclic placements; the topology each rank sees; the two-level algorithms chosen, named by
COMM_DEBUG, and equal to the flat ones; and faults across hosts."""
from __future__ import annotations

import io
import os
import sys
import time

import numpy as np
import pytest

import comm
from bench.cluster import NetnsCluster, unavailable
from harness import Cluster, assert_no_problems
from reference import dtypes
from test_conformance import (check_all_reduce, check_all_to_all, check_p2p, check_reduce_scatter_all_gather,
                              check_rooted, check_split_and_async)
from comm.types import DType
from transports import base

_why = unavailable() or base.unavailable_reason("native")
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))
TIMEOUT = 6.0   # COMM_TIMEOUT of the fault cases


@pytest.fixture(scope="module")
def hosts():
    with NetnsCluster(3) as h:
        yield h


def start(hosts, placement, **env):
    """A rank cluster with rank r on host placement[r]."""
    return Cluster(len(placement), netns=[hosts.ns[h] for h in placement], timeout=120,
                   env=dict({"MASTER_ADDR": hosts.addr(placement[0]), "COMM_TIMEOUT": "60"}, **env))


def debug_log(fn):
    """fn() with COMM_DEBUG=1; returns (its result, what it logged)."""
    saved, sys.stderr = sys.stderr, io.StringIO()
    os.environ["COMM_DEBUG"] = "1"
    try:
        return fn(), sys.stderr.getvalue()
    finally:
        del os.environ["COMM_DEBUG"]
        sys.stderr = saved


def with_algo(world, algo):
    """A copy of `world` (split) whose engine was created under COMM_ALGO=algo."""
    os.environ["COMM_ALGO"] = algo
    try:
        return world.split(0)
    finally:
        del os.environ["COMM_ALGO"]


def suite(world, placement):
    r, n = world.rank, world.size
    problems = []
    topo = world.topology
    want = tuple(tuple(q for q in range(n) if placement[q] == h) for h in dict.fromkeys(placement))
    if topo.hosts != want:
        problems.append(f"rank {r}: topology {topo.hosts}, want {want}")
    two_level = topo.hierarchical
    problems += check_all_reduce(world, dtypes(DType.FLOAT32, DType.BFLOAT16, DType.INT32), [0, 1, 1001, 70_001])
    problems += check_reduce_scatter_all_gather(world, [DType.FLOAT32, DType.INT32], [1, 5000])
    problems += check_rooted(world, [DType.FLOAT32], [1, 100_003])
    problems += check_all_to_all(world, [DType.FLOAT32], 4)
    problems += check_p2p(world)
    problems += check_split_and_async(world)
    # the algorithm each kind ran, then the same calls forced flat and forced two-level
    flat, forced = with_algo(world, "flat"), with_algo(world, "twolevel")
    x = (np.arange(1 << 20, dtype=np.int64) * (r + 1)) % 1000   # integers: every order gives one result
    f = np.random.default_rng(r).standard_normal(300_001).astype(np.float32)
    results, used = {}, {}
    for name, c in (("auto", world), ("flat", flat), ("twolevel", forced)):
        out = {}
        for kind, call in [("all_reduce", lambda c, a: c.all_reduce(a)),
                           ("broadcast", lambda c, a: c.broadcast(a, root=n - 1)),
                           ("all_gather", lambda c, a: c.all_gather(np.empty(a.size * n, a.dtype), a)),
                           ("barrier", lambda c, a: c.barrier())]:
            for label, a in (("int", x), ("float", f), ("small", x[:3])):
                a = a.copy()
                got = call(c, a)
                out[kind, label] = a if got is None else got
                used.setdefault((name, kind), set()).add(c._transport.last_algorithm)
        results[name] = out
    for key, value in results["auto"].items():
        for other in ("flat", "twolevel"):
            if key[1] == "float" and key[0] == "all_reduce":
                ok = np.allclose(results[other][key], value, rtol=1e-5, atol=1e-5)
            else:
                ok = np.array_equal(results[other][key], value)
            if not ok:
                problems.append(f"rank {r}: {key} differs between the automatic choice and COMM_ALGO={other}")
    for kind in ("all_reduce", "broadcast", "barrier"):
        if ("twolevel" in used["auto", kind]) != two_level or "twolevel" in used["flat", kind]:
            problems.append(f"rank {r}: {kind} ran {used['auto', kind]} (flat: {used['flat', kind]}); "
                            f"two-level expected: {two_level}")
    # COMM_DEBUG logs the topology and names the two-level choice
    _, text = debug_log(lambda: world.split(0).all_reduce(x.copy()))
    if f"topology {topo.num_hosts} host(s)" not in text or ("uses algorithm twolevel" in text) != two_level:
        problems.append(f"rank {r}: COMM_DEBUG said {text!r}")
    # a split's own topology: the ranks of even rank on their hosts
    sub = world.split(r % 2)
    sub_hosts = [placement[q] for q in range(n) if q % 2 == r % 2]
    want = tuple(tuple(i for i, h in enumerate(sub_hosts) if h == host) for host in dict.fromkeys(sub_hosts))
    if sub.topology.hosts != want:
        problems.append(f"rank {r}: split topology {sub.topology.hosts}, want {want}")
    for c in (flat, forced, sub):
        c.close()
    return problems


PLACEMENTS = {"2x2": [0, 0, 1, 1], "3x1": [0, 1, 2], "3+1": [0, 0, 0, 1], "cyclic": [0, 1, 0, 1]}


@pytest.mark.parametrize("name", PLACEMENTS)
def test_placement(hosts, name):
    placement = PLACEMENTS[name]
    c = start(hosts, placement)
    try:
        before = sum(hosts.tx_bytes(h) for h in set(placement))
        assert_no_problems(c.run(suite, placement, timeout=240))
        moved = sum(hosts.tx_bytes(h) for h in set(placement)) - before
    finally:
        c.close()
    assert moved > 4 << 20, f"only {moved} bytes crossed the links: the cross-host path was not used"


def pid(world):
    return os.getpid()


def storm(world, kind, seconds):
    """Checked all_reduce or all_to_all in a loop until an error; returns (error type, wrong results)."""
    n, r = world.size, world.rank
    wrong = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if kind == "all_reduce":
                x = np.full(1 << 20, float(r + 1), np.float32)
                world.all_reduce(x)
                wrong += not (x == n * (n + 1) / 2).all()
            else:
                x = np.repeat(np.arange(n, dtype=np.float32) + 10 * r, 1 << 16)
                out = np.empty_like(x)
                world.all_to_all(out, x)
                wrong += not (out == np.repeat(np.arange(n, dtype=np.float32) * 10 + r, 1 << 16)).all()
    except comm.CommError as e:
        return type(e).__name__, wrong
    return None, wrong


@pytest.mark.parametrize("fault,kind", [("kill", "all_reduce"), ("cut", "all_to_all"),
                                        ("cut", "all_reduce"), ("kill", "all_to_all")])
def test_host_lost(hosts, fault, kind):
    """2 hosts x 2 ranks; host 1's ranks killed at once, or its link cut, mid-operation: every
    survivor fails with PeerFailure or CommTimeout within the timeout and saw no wrong result."""
    placement = [0, 0, 1, 1]
    c = start(hosts, placement, COMM_TIMEOUT=str(TIMEOUT))
    try:
        pids = c.run(pid)   # also imports this module on the ranks before the clock starts
        c.submit(storm, kind, 60)
        time.sleep(1.0)
        if fault == "kill":
            for p in pids[2:]:
                os.kill(p, 9)
            survivors = [0, 1]
        else:
            hosts.cut(1)
            survivors = [0, 1, 2, 3]
        results = c.collect(survivors, TIMEOUT + 15)
    finally:
        c.kill()
        if fault == "cut":
            hosts.restore(1)
    for r, (ok, value, seconds) in results.items():
        assert ok, f"rank {r}: {value}"
        error, wrong = value
        assert error in ("PeerFailure", "CommTimeout"), f"rank {r}: {error}"
        assert wrong == 0, f"rank {r}: {wrong} wrong results"
        assert seconds < TIMEOUT + 3, f"rank {r} took {seconds:.1f} s"


def test_probe_namespaces_of_dead_processes_are_removed():
    """A process killed between creating its probe namespace and deleting it leaves one
    behind; the next probe removes it (and never one of a live process)."""
    import subprocess

    from bench import cluster
    dead = 2 ** 22 + 1   # above the default pid_max: no process has it
    while os.path.exists(f"/proc/{dead}"):
        dead += 1
    stale, live = f"commprobe{dead}", f"commprobe{os.getpid()}"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        cluster._remove_stale_probes()
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in names and live in names, names
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
