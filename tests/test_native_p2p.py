"""Native send / recv: MPI-style non-blocking semantics (see native/src/core/README.md, "Send / recv").

Any posting order of isend / irecv completes; same (peer, tag) messages match in order,
different tags in any order; p2p progresses independently of collectives; failures are
bounded by the timeout and reported, never silent."""
import random
import time

import numpy as np
import pytest

import comm
from harness import Cluster, abort_while_blocked, run_ranks

CHANNELS = ["auto", "tcp"]


def _env(channels, timeout="30"):
    return {"COMM_CHANNELS": channels, "COMM_TIMEOUT": timeout}


def _payload(src, dst, k, n):
    return (np.arange(n, dtype=np.float32) + 1000 * src + 100 * dst + 7 * k).astype(np.float32)


# ---- receive posted before the send ---------------------------------------------------------

def _recv_first(world):
    peers = [p for p in range(world.size) if p != world.rank]
    bufs = {p: np.zeros(4, np.float32) for p in peers}
    recvs = [world.irecv(bufs[p], p) for p in peers]  # every rank receives first
    sends = [world.isend(_payload(world.rank, p, 0, 4), p) for p in peers]
    for w in recvs + sends:
        w.wait()
    return all(np.array_equal(bufs[p], _payload(p, world.rank, 0, 4)) for p in peers)


@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("n", [2, 3])
def test_irecv_before_isend(n, channels):
    assert run_ranks(_recv_first, n, env=_env(channels), timeout=90) == [True] * n


def _blocking_after_irecv(world):
    peer = 1 - world.rank
    got = np.zeros(4, np.float32)
    w = world.irecv(got, peer)
    world.send(_payload(world.rank, peer, 0, 4), peer)  # blocking send behind a posted irecv
    w.wait()
    return bool(np.array_equal(got, _payload(peer, world.rank, 0, 4)))


@pytest.mark.parametrize("channels", CHANNELS)
def test_blocking_send_after_posted_irecv(cluster, channels):
    assert cluster(2, env=_env(channels)).run(_blocking_after_irecv) == [True, True]


# ---- tags ------------------------------------------------------------------------------------

def _reversed_tags(world, tags):
    if world.rank == 0:
        works = [world.isend(_payload(0, 1, t, 10 + 5000 * (t % 3)), 1, tag=t) for t in range(tags)]
        works += [world.isend(_payload(0, 1, 100 + k, 33), 1, tag=tags) for k in range(3)]
        for w in works:
            w.wait()
        return True
    bufs = {t: np.zeros(10 + 5000 * (t % 3), np.float32) for t in range(tags)}
    same = [np.zeros(33, np.float32) for _ in range(3)]
    works = [world.irecv(bufs[t], 0, tag=t) for t in reversed(range(tags))]
    time.sleep(0.2)  # messages of other tags arrive while the first receive waits
    works += [world.irecv(b, 0, tag=tags) for b in same]
    for w in works:
        w.wait()
    ok = all(np.array_equal(bufs[t], _payload(0, 1, t, bufs[t].size)) for t in range(tags))
    return ok and all(np.array_equal(same[k], _payload(0, 1, 100 + k, 33)) for k in range(3))


@pytest.mark.parametrize("channels", CHANNELS)
def test_tags_received_in_reversed_order(cluster, channels):
    assert cluster(2, env=_env(channels)).run(_reversed_tags, 40) == [True, True]


# ---- many mixed operations in random order ---------------------------------------------------

def _plan(size, per_rank, seed):
    """Messages (src, dst, tag, count) every rank derives alike; each rank posts per_rank ops."""
    rng = random.Random(seed)
    msgs = []
    for src in range(size):
        for _ in range(per_rank // 2):
            dst = rng.choice([p for p in range(size) if p != src])
            count = rng.choice([0, 1, 7, 1000, 40_000, 70_000])  # up to 280 KB > a ring
            msgs.append((src, dst, rng.randrange(4), count))
    return msgs


def _random_order(world, per_rank, seed):
    msgs = _plan(world.size, per_rank, seed)
    ops = []  # (kind, peer, tag, index of the message)
    for i, (src, dst, tag, count) in enumerate(msgs):
        if src == world.rank:
            ops.append(("s", dst, tag, i))
        if dst == world.rank:
            ops.append(("r", src, tag, i))
    # Shuffle, but keep each (kind, peer, tag) group in message order: that order is what
    # same-(peer, tag) matching promises.
    rng = random.Random(seed * 31 + world.rank)
    slots = list(range(len(ops)))
    rng.shuffle(slots)
    groups: dict = {}
    for slot, op in zip(slots, ops):
        groups.setdefault(op[:3], []).append(slot)
    order = [None] * len(ops)
    for op in ops:
        order[min(groups[op[:3]])] = op
        groups[op[:3]].remove(min(groups[op[:3]]))
    bufs, works = {}, []
    for kind, peer, tag, i in order:
        src, dst, _, count = msgs[i]
        if kind == "s":
            bufs[("s", i)] = _payload(src, dst, i, count)
            works.append(world.isend(bufs[("s", i)], peer, tag=tag))
        else:
            bufs[("r", i)] = np.full(count, -1, np.float32)
            works.append(world.irecv(bufs[("r", i)], peer, tag=tag))
    rng.shuffle(works)
    for w in works:
        w.wait()
    bad = [i for (kind, i), b in bufs.items()
           if kind == "r" and not np.array_equal(b, _payload(msgs[i][0], msgs[i][1], i, msgs[i][3]))]
    return len(order), bad


@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("n", [2, 3])
def test_hundred_mixed_ops_in_random_order(cluster, n, channels):
    results = cluster(n, env=_env(channels)).run(_random_order, 100, 1234 + n)
    assert all(bad == [] for _, bad in results), results
    assert sum(count for count, _ in results) == 2 * 50 * n


# ---- large messages --------------------------------------------------------------------------

def _large_both_ways(world, recv_first):
    peer = 1 - world.rank
    n = 4 << 20  # 16 MiB of float32
    out = np.full(n, world.rank + 1, np.float32)
    out[::4096] = np.arange(0, n, 4096) % 1000
    got = np.zeros(n, np.float32)
    if recv_first:
        works = [world.irecv(got, peer), world.isend(out, peer)]
    else:
        works = [world.isend(out, peer), world.irecv(got, peer)]
    for w in works:
        w.wait()
    want = np.full(n, peer + 1, np.float32)
    want[::4096] = np.arange(0, n, 4096) % 1000
    return bool(np.array_equal(got, want))


@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("recv_first", [True, False])
def test_16mib_both_directions_at_once(cluster, channels, recv_first):
    assert cluster(2, env=_env(channels)).run(_large_both_ways, recv_first) == [True, True]


# ---- p2p interleaved with collectives --------------------------------------------------------

def _p2p_around_collectives(world):
    peer = 1 - world.rank
    small, big = np.zeros(4, np.float32), np.zeros(1 << 20, np.float32)  # big: 4 MiB > a ring
    # 1. irecv posted, then a collective, then the matching isend.
    r = world.irecv(small, peer, tag=1)
    x = np.ones(1000, np.float32)
    world.all_reduce(x)
    s = world.isend(_payload(world.rank, peer, 1, 4), peer, tag=1)
    r.wait()
    s.wait()
    ok = bool(np.array_equal(small, _payload(peer, world.rank, 1, 4)) and x[0] == 2)
    # 2. A large isend in flight across a collective; its irecv is posted only afterwards.
    if world.rank == 0:
        s = world.isend(np.full(1 << 20, 5, np.float32), 1, tag=2)
        world.all_reduce(x)
        world.barrier()
        s.wait()
    else:
        world.all_reduce(x)
        world.barrier()
        world.recv(big, 0, tag=2)
        ok = ok and bool((big == 5).all())
    # 3. Async collectives and p2p posted together, waited in reverse.
    works = [world.irecv(small, peer, tag=3), world.all_reduce(x, async_op=True),
             world.isend(np.full(4, world.rank, np.float32), peer, tag=3)]
    for w in reversed(works):
        w.wait()
    return ok and bool((small == peer).all() and x[0] == 8)


@pytest.mark.parametrize("channels", CHANNELS)
def test_p2p_interleaved_with_collectives(cluster, channels):
    assert cluster(2, env=_env(channels)).run(_p2p_around_collectives) == [True, True]


# ---- failures --------------------------------------------------------------------------------

def _unmatched_irecv(world):
    start = time.perf_counter()
    if world.rank == 1:
        time.sleep(3)
        return "idle", 0.0
    try:
        world.irecv(np.zeros(4, np.float32), 1).wait()
    except comm.CommError as e:
        return type(e).__name__, time.perf_counter() - start
    return "ok", time.perf_counter() - start


def test_unmatched_irecv_times_out():
    results = run_ranks(_unmatched_irecv, 2, env=_env("auto", "1.5"), timeout=60, expect_errors=True)
    kind, took = results[0]
    assert kind == "CommTimeout" and 1.4 < took < 4, results[0]


def _abort_waiting_irecv(world):
    if world.rank == 1:
        time.sleep(3)
        return "idle", 0.0
    w = world.irecv(np.zeros(4, np.float32), 1)
    return abort_while_blocked(world, w.wait)


def test_abort_unblocks_a_waiting_irecv():
    results = run_ranks(_abort_waiting_irecv, 2, timeout=60, expect_errors=True)
    kind, took = results[0]
    assert kind == "Aborted" and took < 1.0, results[0]


def _dead_sender(world):
    import os
    if world.rank == 1:
        os._exit(3)
    try:
        world.irecv(np.zeros(1 << 16, np.float32), 1).wait()
    except comm.PeerFailure as e:
        return "PeerFailure", e.peer
    except comm.CommError as e:
        return type(e).__name__, None
    return "ok", None


@pytest.mark.parametrize("channels", CHANNELS)
def test_dead_peer_fails_a_pending_irecv(channels):
    c = Cluster(2, env=_env(channels))
    try:
        c.submit(_dead_sender)
        out = c.collect([0], timeout=60)
    finally:
        c.close()
    ok, value, waited = out[0]
    assert ok and value == ("PeerFailure", 1), value
    assert waited < 15


def _size_mismatch(world):
    peer = 1 - world.rank
    got = np.full(8, -1, np.float32)
    try:
        if world.rank == 0:
            world.isend(np.ones(10, np.float32), peer).wait()
        r = world.irecv(got, peer) if world.rank == 1 else None
        if r is not None:
            r.wait()
    except comm.Mismatch:
        return "Mismatch", bool((got == -1).all())
    except comm.CommError as e:
        return type(e).__name__, True
    return "ok", True


def test_size_mismatch_fails_not_corrupts():
    results = run_ranks(_size_mismatch, 2, env=_env("auto", "5"), timeout=60, expect_errors=True)
    assert results[1] == ("Mismatch", True), results
