"""Engine behaviour beyond results: 64-bit sizes, async overlap, oversubscription, failures,
and shared-memory hygiene."""
import glob
import os
import time

import numpy as np
import pytest

import comm
from harness import Cluster, abort_while_blocked, build_native_test, run_ranks


def test_engine_reduces_what_the_communicator_allows():
    """The engine's one argument check (validate.cc: check_op) refuses a reduction it has no
    kernel for; the lean path relies on it, so it must take exactly the (op, dtype) pairs
    comm.core.types.op_allowed lets through the full path."""
    import transports.native  # noqa: F401  (hands the engine its error classes)
    from comm import _native
    from comm.core.types import DType, ReduceOp, op_allowed
    differ = []
    for op in ReduceOp:
        for dtype in DType:
            try:
                _native.reduce_into(int(dtype), int(op), 0, 0, 0)
                kernel = True
            except comm.InvalidArgument:
                kernel = False
            if kernel != op_allowed(op, dtype):
                differ.append((op.name, dtype.name, kernel))
    assert not differ, differ


def _all_reduce_3gib(world):
    n = 3 << 30
    x = np.empty(n, np.uint8)
    x[:] = world.rank + 1
    x[-1] = 7 * world.rank
    world.all_reduce(x)
    want = sum(range(1, world.size + 1))
    return bool((x[:: 1 << 20] == want).all() and x[n // 2 + 12345] == want and
                x[-2] == want and x[-1] == 7 * sum(range(world.size))), world.session.transport.last_algorithm


@pytest.mark.slow
def test_three_gib_buffer():
    """Byte counts past 2**31 and 2**32 stay exact (uint8 SUM keeps it quick)."""
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if avail < 8 << 30:
        pytest.skip(f"needs 8 GiB of free memory, {avail >> 30} GiB available")
    results = run_ranks(_all_reduce_3gib, 2, timeout=300)
    assert all(ok for ok, _ in results), results


def _overlap(world):
    x = np.ones(16 << 20, np.float32)
    start = time.perf_counter()
    work = world.all_reduce(x, async_op=True)
    posted = time.perf_counter() - start
    busy = 0
    while not work.is_completed():
        busy += 1  # Python keeps running while the engine works
    work.wait()
    # A blocking op posted after async ones runs after them (in order).
    y = np.full(10, world.rank, np.float32)
    works = [world.all_reduce(np.ones(1000, np.float32), async_op=True) for _ in range(5)]
    world.all_reduce(y)
    for w in works:
        assert w.is_completed()
    return posted, busy, float(x[0]), float(y[0])


def test_async_overlaps_python(cluster):
    results = cluster(2).run(_overlap)
    for posted, busy, x0, y0 in results:
        assert posted < 0.05, f"posting took {posted:.3f} s: async_op must return at once"
        assert busy > 0, "the async op completed before Python ran again"
        assert x0 == 2.0 and y0 == 1.0


def _unwaited_async_progresses(world, channels):
    """Rank 0 posts a small all_reduce and blocks in a receive that rank 1 sends only after
    its own (blocking) all_reduce: it completes only if rank 0's op progresses without a
    wait. Then Works never waited for, and a blocking call after them, in posting order."""
    x = np.full(4, world.rank + 1, np.float32)
    flag = np.zeros(1, np.int32)
    if world.rank == 0:
        work = world.all_reduce(x, async_op=True)
        world.recv(flag, 1)
        work.wait()
    else:
        world.all_reduce(x)
        world.send(np.ones(1, np.int32), 0)
    ys = [np.full(3, i + world.rank, np.float32) for i in range(20)]
    for y in ys:
        world.all_reduce(y, async_op=True)   # dropped unwaited
    z = np.full(2, world.rank, np.float32)
    world.all_reduce(z)
    return float(x[0]), [float(y[0]) for y in ys], float(z[0])


@pytest.mark.parametrize("channels", ["auto", "tcp"])
def test_async_progresses_without_a_wait(channels):
    results = run_ranks(_unwaited_async_progresses, 2, channels, env={"COMM_CHANNELS": channels},
                        timeout=120)
    for x0, ys, z0 in results:
        assert x0 == 3.0 and z0 == 1.0
        assert ys == [2.0 * i + 1 for i in range(20)]


def _progress_after_quick_waits(world):
    """A second of async ops each waited for at once (their waiters run them, so the progress
    thread looks at the queue less and less often), then one that rank 0 leaves unwaited for
    3 s: rank 1's blocking all_reduce must still end long before that wait."""
    x = np.full(4, world.rank, np.int32)
    h = world.all_reduce_init(x, op=comm.MAX)
    end = time.monotonic() + 1.0
    while not world.agree(int(time.monotonic() > end)):   # every rank the same number of calls
        for _ in range(500):
            world.all_reduce(x, op=comm.MAX, async_op=True).wait()
            h.start()
            h.wait()
    world.barrier()
    y = np.full(4, world.rank + 1, np.float32)
    if world.rank == 0:
        work = world.all_reduce(y, async_op=True)
        time.sleep(3)
        done_before_wait = work.is_completed()
        work.wait()
        return done_before_wait, float(y[0]), float(x[0])
    start = time.perf_counter()
    world.all_reduce(y)
    return time.perf_counter() - start, float(y[0]), float(x[0])


def test_unwaited_op_progresses_after_many_quick_waits():
    results = run_ranks(_progress_after_quick_waits, 2, timeout=120)
    (done_before_wait, y0, x0), (took, y1, x1) = results
    assert done_before_wait, "rank 0's unwaited op did not complete before its wait"
    assert took < 0.5, f"rank 1 waited {took:.2f} s for rank 0's unwaited op"
    assert y0 == y1 == 3.0 and x0 == x1 == 1.0


def _wait_timeout(world):
    """Rank 1 never joins: rank 0's wait, which runs the op on its own thread, ends at the
    wait's timeout, not the communicator's."""
    if world.rank == 1:
        time.sleep(4)
        return "idle", 0.0
    work = world.all_reduce(np.ones(4, np.float32), async_op=True)
    start = time.perf_counter()
    try:
        work.wait(timeout=0.5)
    except comm.CommTimeout:
        return "CommTimeout", time.perf_counter() - start
    return "ok", time.perf_counter() - start


def test_wait_timeout_bounds_an_op_run_by_the_waiter():
    results = run_ranks(_wait_timeout, 2, env={"COMM_TIMEOUT": "30"}, timeout=60, expect_errors=True)
    kind, took = results[0]
    assert kind == "CommTimeout" and took < 3, results[0]


def _work_forms(world):
    """The lean path's Work (a plain array: the engine's request, posted in one native call) and
    the full path's (scale= takes it) behave alike: comm.Work, callbacks once, outcome kept,
    failures named and kept."""
    import gc
    import sys
    import weakref
    seen = {}
    for form, kwargs in (("lean", {}), ("full", {"scale": 1.0})):
        x = np.full(4, world.rank + 1, np.float32)
        calls = []
        w = world.all_reduce(x, async_op=True, **kwargs)
        w.add_done_callback(calls.append)          # before the end: called by wait()
        w.wait()
        w.add_done_callback(calls.append)          # after it: called at once
        w.wait()                                   # a second wait returns at once
        seen[form] = (type(w).__name__, isinstance(w, comm.Work), [c is w for c in calls],
                      w.is_completed(), w.exception(), w.source, float(x[0]))
        # a dropped, unwaited Work holds its buffer until the operation ends (the array has no
        # other owner here), and one in a reference cycle is still collected
        before = sys.getrefcount(x)
        w = world.all_reduce(x, async_op=True, **kwargs)
        callback = lambda _, w=w: None             # noqa: E731 (a cycle: Work -> callback -> Work)
        w.add_done_callback(callback)
        held = sys.getrefcount(x) > before
        gone = weakref.ref(callback)
        del w, callback
        gc.collect()
        world.barrier()
        seen[form] += (held, float(x[0]), gone() is None)
    # a failure: rank 1 never joins, rank 0's wait times out; the error is kept and named
    if world.rank == 0:
        w = world.all_reduce(np.ones(4, np.float32), async_op=True)
        try:
            w.wait(timeout=0.3)
        except comm.CommTimeout as e:
            again = None
            try:
                w.wait()
            except comm.CommTimeout as e2:
                again = e2
            seen["failed"] = (e.rank, e.op, again is e, w.exception() is e, w.is_completed(),
                              type(_raises(lambda: world.all_reduce(np.ones(1, np.float32)))).__name__)
    else:
        time.sleep(1.5)
    return seen


def _raises(fn):
    try:
        fn()
    except comm.CommError as e:
        return e
    return None


def test_work_forms_behave_alike():
    results = run_ranks(_work_forms, 2, env={"COMM_TIMEOUT": "30"}, timeout=60, expect_errors=True)
    for rank, seen in enumerate(results):
        lean, full = seen["lean"], seen["full"]
        assert lean[0] == full[0] == "Work", (lean, full)
        for form in (lean, full):
            assert form[1:7] == (True, [True, True], True, None, -1, 3.0), form
            assert form[7], f"the unwaited Work did not hold its buffer: {form}"
            assert form[8] == 6.0, form   # (the dropped op's result: 3 + 3)
            assert form[9], f"a Work in a reference cycle was never collected: {form}"
    assert results[0]["failed"] == (0, "all_reduce", True, True, True, "Aborted"), results[0]


def _latency_loop(world, iters):
    x = np.ones(2, np.float32)
    big = np.ones(1 << 18, np.float32)
    start = time.perf_counter()
    for _ in range(iters):
        world.all_reduce(x)
    world.all_reduce(big)
    world.barrier()
    return (time.perf_counter() - start) / iters, float(big[0])


@pytest.mark.slow
def test_eight_ranks_on_two_cores():
    """Oversubscribed ranks must sleep, not spin: 8 ranks on this machine still progress."""
    results = run_ranks(_latency_loop, 8, 300, timeout=180)
    for per_op, big0 in results:
        assert big0 == 8.0
        assert per_op < 0.01, f"{per_op * 1e6:.0f} us per 8-byte all_reduce with 8 ranks"


def _split_and_close(world, rounds: int):
    x = np.ones(4, np.float32)
    fds = []
    for _ in range(rounds):
        sub = world.split(0)
        sub.all_reduce(x)
        sub.close()
        world.barrier()
        fds.append(len(os.listdir("/proc/self/fd")))
    return fds


@pytest.mark.parametrize("connect", ["lazy", "eager"])
def test_a_closed_communicator_releases_its_engine(cluster, connect):
    """A communicator closed and dropped takes its engine with it: descriptors stay flat over
    splits made and closed. (The set-up once kept each transport alive from the acceptor's
    finalizer, and every closed engine's eventfds with it: one descriptor more per split.)"""
    for fds in cluster(3, env={"COMM_CONNECT": connect}).run(_split_and_close, 4):
        assert len(set(fds)) == 1, fds


def _no_segments_left(world):
    return sorted(glob.glob("/dev/shm/comm-*"))


def test_shared_memory_unlinked_after_setup(cluster):
    """Shared memory has no name in /dev/shm (memfd): a crash at any point leaks nothing."""
    assert cluster(3).run(_no_segments_left) == [[], [], []]


@pytest.mark.slow   # links the engine library built with sanitizers: about 90 s on 2 cores, once
def test_memfd_helpers():
    """native/tests/memfd_test.cc, built with warnings as errors and sanitizers: the one way every
    segment is created (mode 0600, close-on-exec, pages reserved, zeroed) and a peer's is mapped
    from another process, and the errors (a peer that exited, a file of the wrong size) naming
    the rank, the path and the cause."""
    assert "all checks passed" in build_native_test("memfd_test")


def _segments_resident(world):
    """(size, resident) in KiB of every shared-memory segment this rank maps (its own and its
    local peers'), read from /proc/self/smaps."""
    found, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            if "memfd:comm-shm" in line:
                current = []
                found.append(current)
            elif current is not None and line.startswith(("Size:", "Rss:")):
                current.append(int(line.split()[1]))
                if len(current) == 2:
                    current = None
    return found


def test_shared_memory_is_in_place_from_the_start(cluster):
    """Every segment (a rank's own and its peers') is allocated and mapped at set-up: left to
    fault in, the first pass through each ring ran 7x slower (the first 16 all_to_alls of
    256 KiB), which short jobs and benchmarks see as the library's speed."""
    for segments in cluster(3).run(_segments_resident):
        assert len(segments) == 3, segments
        assert all(rss == size for size, rss in segments), segments


def _die_or_all_reduce(world):
    if world.rank == world.size - 1:
        os._exit(3)
    time.sleep(0.5)
    try:
        world.all_reduce(np.ones(1 << 16, np.float32))
    except comm.PeerFailure as e:
        return "PeerFailure", e.peer, str(e)
    return "no error", None, ""


@pytest.mark.parametrize("channels", ["auto", "tcp"])
def test_dead_peer_named_on_every_rank(channels):
    c = Cluster(3, env={"COMM_CHANNELS": channels, "COMM_TIMEOUT": "30"})
    try:
        c.submit(_die_or_all_reduce)
        out = c.collect([0, 1], timeout=60)
    finally:
        c.close()
    for rank, (ok, value, waited) in out.items():
        assert ok, value
        kind, peer, msg = value
        assert kind == "PeerFailure" and peer == 2, (rank, value)
        assert waited < 15, f"rank {rank} needed {waited:.1f} s to notice the dead peer"


def _one_rank_late(world, late_s):
    start = time.perf_counter()
    try:
        if world.rank == 1:
            time.sleep(late_s)
        world.all_reduce(np.ones(10, np.float32))
    except comm.CommTimeout as e:
        return "CommTimeout", time.perf_counter() - start, str(e)
    except comm.CommError as e:
        return type(e).__name__, time.perf_counter() - start, str(e)
    return "ok", time.perf_counter() - start, ""


def test_timeout_bounds_every_wait():
    results = run_ranks(_one_rank_late, 2, 4.0, env={"COMM_TIMEOUT": "1.5"}, timeout=60, expect_errors=True)
    kind, took, msg = results[0]
    assert kind == "CommTimeout" and 1.4 < took < 4, results[0]
    assert "[rank 0] all_reduce" in msg


def _abort_from_thread(world):
    if world.rank == 1:
        time.sleep(3)
        return "idle", 0.0
    return abort_while_blocked(world, lambda: world.all_reduce(np.ones(10, np.float32)))


def test_abort_unblocks_a_waiting_thread():
    results = run_ranks(_abort_from_thread, 2, timeout=60, expect_errors=True)
    kind, took = results[0]
    assert kind == "Aborted" and took < 1.0, results[0]


def _mismatched_counts(world, channels):
    try:
        world.all_reduce(np.ones(10 + world.rank, np.float32))
    except comm.Mismatch as e:
        return "Mismatch", str(e)
    except comm.CommError as e:
        return type(e).__name__, str(e)
    return "ok", ""


@pytest.mark.parametrize("channels", ["auto", "tcp"])
def test_mismatched_collectives_fail_not_corrupt(channels):
    results = run_ranks(_mismatched_counts, 2, channels, env={"COMM_CHANNELS": channels, "COMM_TIMEOUT": "5"},
                        timeout=60, expect_errors=True)
    assert any(kind == "Mismatch" for kind, _ in results), results
    assert all(kind != "ok" for kind, _ in results), results


def test_busy_lock_is_a_lock():
    """The communicator's one-collective-at-a-time lock, which the engine's lean calls take
    natively: Lock semantics (non-blocking and blocking acquire, release, misuse refused)."""
    import threading
    from comm._native import BusyLock
    lock = BusyLock()
    assert lock.acquire(False) and lock.locked()
    assert not lock.acquire(False)
    got = []
    t = threading.Thread(target=lambda: got.append(lock.acquire()))   # blocks until released
    t.start()
    time.sleep(0.1)
    assert not got
    lock.release()
    t.join(5)
    assert got == [True] and lock.locked()
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()
