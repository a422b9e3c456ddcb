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
from harness import Cluster, assert_no_problems, slow
from reference import dtypes
from test_moe import _check_layer, ep_layer_all
from test_conformance import (check_all_reduce, check_all_to_all, check_p2p, check_reduce_scatter_all_gather,
                              check_rooted, check_split_and_async)
from comm.core.types import DType
from transports import base

_why = unavailable() or base.unavailable_reason("native")
pytestmark = pytest.mark.skipif(_why is not None, reason=str(_why))
TIMEOUT = 6.0   # COMM_TIMEOUT of the fault cases


@pytest.fixture(scope="module")
def hosts():
    with NetnsCluster(3) as h:
        yield h


def start(hosts, placement, transport="native", **env):
    """A rank cluster with rank r on host placement[r]."""
    return Cluster(len(placement), transport, netns=[hosts.ns[h] for h in placement], timeout=120,
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
    problems += check_segmented(world)
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
                used.setdefault((name, kind), set()).add(c.session.transport.last_algorithm)
        results[name] = out
    for key, value in results["auto"].items():
        for other in ("flat", "twolevel"):
            if key[1] == "float" and key[0] == "all_reduce":
                ok = np.allclose(results[other][key], value, rtol=1e-5, atol=1e-5)
            else:
                ok = np.array_equal(results[other][key], value)
            if not ok:
                problems.append(f"rank {r}: {key} differs between the automatic choice and COMM_ALGO={other}")
    # reduce_scatter and all_gather take two levels only where every host holds two or more
    # ranks (a host of one moves n-1 blocks either way: no link carries less)
    shards = two_level and all(len(h) > 1 for h in topo.hosts)
    for kind, expected in (("all_reduce", two_level), ("broadcast", two_level), ("all_gather", shards),
                           ("barrier", two_level)):
        if ("twolevel" in used["auto", kind]) != expected or "twolevel" in used["flat", kind]:
            problems.append(f"rank {r}: {kind} ran {used['auto', kind]} (flat: {used['flat', kind]}); "
                            f"two-level expected: {expected}")
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
    # reduce_scatter: two-level where every host is shared, uneven placements included
    def rs_input(q):
        return (np.arange(n * 4099, dtype=np.int64) * (q + 3)) % 10_007
    want = sum(rs_input(q) for q in range(n))[r * 4099:(r + 1) * 4099]
    for name, c in (("auto", world), ("flat", flat)):
        out = np.empty(4099, np.int64)
        c.reduce_scatter(out, rs_input(r))
        algo = c.session.transport.last_algorithm
        if not np.array_equal(out, want):
            problems.append(f"rank {r}: reduce_scatter wrong under {name} ({algo})")
        if (algo == "twolevel") != (shards and name == "auto"):
            problems.append(f"rank {r}: reduce_scatter ran {algo} under {name}; two-level expected: {shards}")
    # all_to_all: aggregated per host pair on every placement that is two-level
    y = (np.arange(n * 5003, dtype=np.int64) * (r + 7)) % 100_003
    swapped = {}
    for name, c in (("auto", world), ("flat", flat), ("twolevel", forced)):
        out = np.empty_like(y)
        c.all_to_all(out, y)
        swapped[name] = out, c.session.transport.last_algorithm
    want = np.concatenate([((np.arange(n * 5003, dtype=np.int64) * (q + 7)) % 100_003)[r * 5003:(r + 1) * 5003]
                           for q in range(n)])
    for name, (out, algo) in swapped.items():
        if not np.array_equal(out, want):
            problems.append(f"rank {r}: all_to_all wrong under {name} ({algo})")
    if (swapped["auto"][1] == "twolevel") != two_level or swapped["flat"][1] == "twolevel":
        problems.append(f"rank {r}: all_to_all ran {swapped['auto'][1]} (flat: {swapped['flat'][1]})")
    for c in (flat, forced, sub):
        c.close()
    return problems


def check_segmented(world):
    """The sharded two-level all_reduce runs in segments of 4 MiB whose network phase overlaps
    the shared-memory phases of its neighbours (reduce_scatter and all_gather too, on uniform
    placements): 4 segments here (the last one an element
    short), in and out of place, integer values so any order of summation is exact."""
    r, n, problems = world.rank, world.size, []
    count = (5 << 20) + 7
    ins = [(np.arange(count, dtype=np.int64) * (q + 3) % 1009).astype(np.int32) for q in range(n)]
    want = sum(a.astype(np.int64) for a in ins).astype(np.int32)
    for inplace in (True, False):
        x = ins[r].copy()
        out = None if inplace else np.empty_like(x)
        world.all_reduce(x, out=out)
        got = x if inplace else out
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            problems.append(f"rank {r}: segmented all_reduce {'in' if inplace else 'out-of'}-place: "
                            f"element {bad} is {got[bad]}, want {want[bad]}")
        if not inplace and not np.array_equal(x, ins[r]):
            problems.append(f"rank {r}: segmented all_reduce changed its input")
    # reduce_scatter and all_gather on uniform placements run the same segments over packed
    # blocks: 4 segments of uneven sizes (each rank's block is not a multiple of 4)
    block = (5 << 20) // n + 3
    rs_ins = [(np.arange(n * block, dtype=np.int64) * (q + 5) % 1013).astype(np.int32) for q in range(n)]
    rs_want = sum(a.astype(np.int64) for a in rs_ins).astype(np.int32)[r * block:(r + 1) * block]
    out = np.empty(block, np.int32)
    world.reduce_scatter(out, rs_ins[r])
    if not np.array_equal(out, rs_want):
        bad = int(np.flatnonzero(out != rs_want)[0])
        problems.append(f"rank {r}: segmented reduce_scatter: element {bad} is {out[bad]}, want {rs_want[bad]}")
    gathered = np.empty(n * block, np.int32)
    world.all_gather(gathered, rs_ins[r][:block])
    ag_want = np.concatenate([a[:block] for a in rs_ins])
    if not np.array_equal(gathered, ag_want):
        bad = int(np.flatnonzero(gathered != ag_want)[0])
        problems.append(f"rank {r}: segmented all_gather: element {bad} is {gathered[bad]}, want {ag_want[bad]}")
    return problems


PLACEMENTS = {"2x2": [0, 0, 1, 1], "3x1": [0, 1, 2], "3+1": [0, 0, 0, 1], "3+2": [0, 0, 0, 1, 1],
              "cyclic": [0, 1, 0, 1]}


@pytest.mark.parametrize("name", ["2x2", *slow("3+2", "3x1", "3+1", "cyclic")])
def test_placement(hosts, name):
    run_suite(hosts, PLACEMENTS[name], "native")


@pytest.mark.parametrize("name", [*slow("2x2", "3+2")])
@pytest.mark.skipif(base.unavailable_reason("ucx") is not None, reason=f"ucx: {base.unavailable_reason('ucx')}")
def test_placement_over_ucx(hosts, name):
    """The engine's algorithms, two-level ones included, over UCX's channels across hosts."""
    run_suite(hosts, PLACEMENTS[name], "ucx")


def striped(world):
    """Payloads on both sides of the stripe threshold (256 KiB), collective and send / recv."""
    r, n = world.rank, world.size
    problems = []
    for count in (1000, 70_000, 3 << 20):
        def part(q):
            return (np.arange(count, dtype=np.int64) * (q + 1) % 997).astype(np.float32)
        x = part(r)
        world.all_reduce(x)
        if not np.array_equal(x, sum(part(q) for q in range(n))):
            problems.append(f"rank {r}: all_reduce of {count} elements wrong")
    y = np.full(n * (1 << 18), float(r), np.float32)
    out = np.empty_like(y)
    world.all_to_all(out, y)
    if not np.array_equal(out, np.repeat(np.arange(n, dtype=np.float32), 1 << 18)):
        problems.append(f"rank {r}: all_to_all wrong")
    big = np.full(1 << 19, float(r + 1), np.float32)
    if r == 0:
        world.send(big, 1)
    elif r == 1:
        world.recv(big, 0)
        if not np.all(big == 1.0):
            problems.append(f"rank {r}: recv wrong")
    return problems


@pytest.mark.parametrize("transport", ["native", pytest.param("ucx", marks=pytest.mark.skipif(
    base.unavailable_reason("ucx") is not None, reason=f"ucx: {base.unavailable_reason('ucx')}"))])
def test_connections_per_peer_differ(hosts, transport):
    """COMM_SOCKETS_PER_PEER set apart on two hosts: the ends agree on the fewer, and striped
    payloads arrive whole."""
    c = Cluster(2, transport, netns=[hosts.ns[0], hosts.ns[1]], timeout=120,
                wrap=[["env", "COMM_SOCKETS_PER_PEER=2"], ["env", "COMM_SOCKETS_PER_PEER=3"]],
                env={"MASTER_ADDR": hosts.addr(0), "COMM_TIMEOUT": "30"})
    try:
        assert_no_problems(c.run(striped, timeout=120))
    finally:
        c.close()


def run_suite(hosts, placement, transport):
    c = start(hosts, placement, transport)
    try:
        before = sum(hosts.tx_bytes(h) for h in set(placement))
        assert_no_problems(c.run(suite, placement, timeout=240))
        moved = sum(hosts.tx_bytes(h) for h in set(placement)) - before
    finally:
        c.close()
    assert moved > 4 << 20, f"only {moved} bytes crossed the links: the cross-host path was not used"


def moe_layer(world):
    return ep_layer_all(world), world.session.transport.last_algorithm


@pytest.mark.parametrize("name", ["2x2", *slow("cyclic", "3+1")])
def test_moe_layer_across_hosts(hosts, name):
    """Expert-parallel dispatch and combine, whose all_to_all_v runs aggregated per host pair."""
    c = start(hosts, PLACEMENTS[name])
    try:
        results = c.run(moe_layer, timeout=240)
    finally:
        c.close()
    _check_layer([layer for layer, _ in results], len(results))
    assert {algo for _, algo in results} == {"twolevel"}, results


def splits_disagree(world, a, b):
    """Rank a expects 5 elements from rank b, which sends 4: that pair fails with Mismatch on
    both ranks; the other two get every block."""
    n, r = world.size, world.rank
    sends, expects = [4] * n, [4] * n
    if r == a:
        expects[b] = 5
    x = np.full(sum(sends), float(r), np.float32)
    out = np.full(sum(expects), -1.0, np.float32)
    try:
        world.all_to_all(out, x, out_splits=expects, in_splits=sends)
    except comm.CommError as e:
        return type(e).__name__, str(e), None
    return None, "", out.tolist()


@pytest.mark.parametrize("placement,a,b", [("2x2", 1, 2), ("2x2", 0, 1), ("3+2", 4, 2), ("3+2", 2, 3)],
                         ids=["across hosts", "same host", "uneven, through a forwarder", "uneven, to a forwarder"])
def test_all_to_all_splits_disagree(hosts, placement, a, b):
    """all_to_all aggregated per host pair: on 2x2 a block from host 1 reaches rank 1 through
    rank 3; on 3+2 rank 2's block for rank 4 goes through rank 1, and rank 3 forwards every
    block of host 1 for rank 2. Each header still names what its source sent and expects."""
    n = len(PLACEMENTS[placement])
    c = start(hosts, PLACEMENTS[placement], COMM_TIMEOUT=str(TIMEOUT))
    try:
        results = c.run(splits_disagree, a, b, timeout=TIMEOUT + 30)
    finally:
        c.kill()
    for r, other in ((a, b), (b, a)):
        error, text, _ = results[r]
        assert error == "Mismatch" and f"rank {other} sends" in text, f"rank {r}: {error} {text}"
    for r in set(range(n)) - {a, b}:
        error, text, out = results[r]
        assert error is None, f"rank {r}: {error} {text}"
        assert out == [float(q) for q in range(n) for _ in range(4)], f"rank {r}: {out}"


def sizes_differ_by_host(world):
    """Host 0 reduces 16 MiB, host 1 8 MiB: both run segments of 4 MiB, so the first segments
    agree in size; only the whole op's signature in every header tells them apart."""
    x = np.ones((4 << 20) if world.topology.host == 0 else (2 << 20), np.float32)
    try:
        world.all_reduce(x)
    except comm.CommError as e:
        return type(e).__name__, str(e)
    return None, ""


def test_segment_sizes_alike_but_ops_differ(hosts):
    c = start(hosts, [0, 0, 1, 1], COMM_TIMEOUT=str(TIMEOUT))
    try:
        t0 = time.monotonic()
        results = c.run(sizes_differ_by_host, timeout=TIMEOUT + 30)
        seconds = time.monotonic() - t0
    finally:
        c.kill()
    # The ranks of host 0 see the mismatch themselves or hear of it from their host peer.
    for r, (error, text) in enumerate(results):
        assert error in ("Mismatch", "PeerFailure"), f"rank {r}: {error} {text}"
    assert any(error == "Mismatch" for error, _ in results), results
    assert seconds < TIMEOUT, f"the mismatch took {seconds:.1f} s to surface"


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
                x = np.full(3 << 20, float(r + 1), np.float32)   # 3 segments of the two-level pipeline
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


@pytest.mark.parametrize("fault,kind,name", [("kill", "all_reduce", "2x2"),
                                             *slow(("cut", "all_to_all", "2x2"),
                                                   ("cut", "all_reduce", "2x2"), ("kill", "all_to_all", "2x2"),
                                                   ("cut", "all_to_all", "3+2"))])
def test_host_lost(hosts, fault, kind, name):
    """Host 1's ranks killed at once, or its link cut, mid-operation (all_to_all on 3+2: its
    blocks go through forwarders): every survivor fails with PeerFailure or CommTimeout within
    the timeout and saw no wrong result."""
    placement = PLACEMENTS[name]
    c = start(hosts, placement, COMM_TIMEOUT=str(TIMEOUT))
    try:
        pids = c.run(pid)   # also imports this module on the ranks before the clock starts
        c.submit(storm, kind, 60)
        time.sleep(1.0)
        if fault == "kill":
            for r, p in enumerate(pids):
                if placement[r] == 1:
                    os.kill(p, 9)
            survivors = [r for r in range(len(placement)) if placement[r] != 1]
        else:
            hosts.cut(1)
            survivors = list(range(len(placement)))
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
