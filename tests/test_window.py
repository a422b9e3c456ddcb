"""One-sided windows (comm.Window): put / get / signals on every engine channel that runs here.

Each channel set-up is its own cluster of real rank processes: shared memory with the
single-copy path (CMA: the origin writes the peer's memory itself), shared memory without it
(COMM_CMA=0: one-sided messages on the shm rings, written in by the target's engine), TCP
(COMM_CHANNELS=tcp) and UCX (RMA with rkeys under COMM_WINDOW_RMA=1, and its default, p2p
messages, as ucx-messages). Results are checked against a numpy model of every window."""
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comm
from harness import Cluster, engine_param, run_ranks
from harness import slow as slow_params

SETUPS = {"cma": ("native", {}), "shm": ("native", {"COMM_CMA": "0"}),
          "tcp": ("native", {"COMM_CHANNELS": "tcp"}), "ucx": ("ucx", {"COMM_WINDOW_RMA": "1"}),
          "ucx-messages": ("ucx", {})}   # UCX's default: the p2p stream


def _reads_back(w, p: int, want: np.ndarray) -> bool:
    """Rank p's whole window, its last byte and an empty read at its end, read back = want."""
    whole, last, empty = np.zeros(w.sizes[p], np.uint8), np.zeros(1, np.uint8), np.zeros(0, np.uint8)
    w.get(p, whole)
    w.get(p, last, w.sizes[p] - 1)
    w.get(p, empty, w.sizes[p])
    w.flush(p)
    return bool(last[0] == whole[-1] and np.array_equal(whole, want))


def _params(slow=()):
    return [engine_param(name, channels="ucx" if name.startswith("ucx") else "auto", slow=name in slow)
            for name in SETUPS]


def _cluster(cluster, name, n=2):
    transport, env = SETUPS[name]
    return cluster(n, transport, env=dict(env, COMM_TIMEOUT="20"))


def _rma_over_ucx(world, w):
    """Over UCX every peer's window is reached by RMA (ucp_put_nbx / ucp_get_nbx / atomics on
    exchanged rkeys) with COMM_WINDOW_RMA=1, else by p2p messages: the case below exercises the
    path it names, not the other one."""
    if world.transport == "ucx":
        paths = [p for r, p in enumerate(w._tw.paths) if r != world.rank]
        want = "rma" if os.environ.get("COMM_WINDOW_RMA", "0") == "1" else "message"
        assert paths == [want] * (world.size - 1), w._tw.paths


def _pattern(rank, n, salt=0):
    return ((np.arange(n, dtype=np.int64) * 7 + rank * 31 + salt) % 251).astype(np.uint8)


# ---- edges: 0 bytes, the last byte, the whole window, signals -----------------------------------

def _edges(world):
    """Rank r writes rank r+1's window (whole, last byte, 0 bytes at the end, a notification)
    and reads every window back (whole, last byte, 0 bytes), its own included."""
    n, me = world.size, world.rank
    size = 4096 + 8 * me   # sizes differ per rank
    buf = np.zeros(size, np.uint8)
    written = {}
    for p in range(n):   # what rank p's window holds at the end: its writer's pattern
        written[p] = _pattern((p - 1) % n, 4096 + 8 * p, 1)
        written[p][-1] = 200 + (p - 1) % n
    with world.window(buf, signals=4) as w:
        _rma_over_ucx(world, w)
        assert w.sizes == tuple(4096 + 8 * p for p in range(n))
        world.barrier()
        p = (me + 1) % n
        w.put(p, _pattern(me, w.sizes[p], 1))                        # the whole window
        w.put(p, np.full(1, 200 + me, np.uint8), w.sizes[p] - 1)   # the last byte
        w.put(p, np.zeros(0, np.uint8), w.sizes[p])                # 0 bytes at the very end
        w.put(p, np.zeros(0, np.uint8), signal=3)                   # a pure notification
        w.flush()
        w.wait_signal(3, 1, timeout=10)
        assert w.signal(3) == 1 and w.signal(0) == 0
        world.barrier()   # every rank's puts landed (flush), so every window is final
        assert np.array_equal(buf, written[me])
        for p in range(n):
            assert _reads_back(w, p, written[p])
        w.fence()
    return True


@pytest.mark.parametrize("name", _params())
def test_edges(cluster, name):
    assert _cluster(cluster, name, 3).run(_edges) == [True] * 3


# ---- many puts in flight, to one and to many peers; disjoint ranges from several origins -------

def _many(world, count, block, allocated=False):
    n, me = world.size, world.rank
    nbytes = n * count * block   # origin o, put i -> block (o * count + i)
    srcs = [[_pattern(me, block, i + 97 * p) for i in range(count)] for p in range(n)]
    buf = None if allocated else np.zeros(nbytes, np.uint8)
    with world.window(nbytes if allocated else buf) as w:
        buf = w.buffer
        _rma_over_ucx(world, w)
        for i in range(count):            # interleaved: every peer has many in flight at once
            for p in range(n):
                w.put(p, srcs[p][i], (me * count + i) * block, signal=me)
        w.flush()
        w.wait_signal(0, 0)
        for o in range(n):
            w.wait_signal(o, count, timeout=20)
        ok = all(np.array_equal(buf[(o * count + i) * block:(o * count + i + 1) * block],
                                _pattern(o, block, i + 97 * me)) for o in range(n) for i in range(count))
        counts = [w.signal(o) for o in range(n)]
    return ok, counts


@pytest.mark.parametrize("name", _params(slow=("ucx", "ucx-messages")))
def test_many_puts_in_flight(cluster, name):
    n = 3
    assert _cluster(cluster, name, n).run(_many, 200, 96) == [(True, [200] * n)] * n


@pytest.mark.parametrize("name", _params(slow=("ucx", "ucx-messages")))
def test_large_puts_and_gets(cluster, name):
    """Blocks past the p2p rings and the TCP socket buffers (several MiB each)."""
    assert _cluster(cluster, name, 3).run(_many, 2, (2 << 20) + 5) == [(True, [2, 2, 2])] * 3


def _target_sleeps(world):
    """Rank 1 sleeps (no engine call at all) while rank 0 puts, signals, gets and flushes:
    the target's engine does the work."""
    buf = np.zeros(1 << 16, np.uint8)
    with world.window(buf) as w:
        _rma_over_ucx(world, w)
        world.barrier()
        if world.rank == 1:
            time.sleep(1.5)
            return bool((buf == 7).all()), w.signal(0)
        t0 = time.monotonic()
        w.put(1, np.full(1 << 16, 7, np.uint8), signal=0)
        back = np.zeros(1 << 16, np.uint8)
        w.get(1, back)
        w.flush()
        return bool((back == 7).all()), time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("name", ["shm", "tcp", engine_param("ucx", channels="ucx")])
def test_target_application_does_nothing(cluster, name):
    assert _cluster(cluster, name).run(_target_sleeps) == [(True, True), (True, 1)]


def _data_before_signal(world, count, block):
    """Rank 0 puts `count` blocks into rank 1's window, each with signal 0 and no flush in
    between; rank 1 checks block i the moment the counter reaches i + 1 (data, then signal)."""
    buf = np.zeros(count * block, np.uint8)
    with world.window(buf) as w:
        _rma_over_ucx(world, w)
        world.barrier()
        if world.rank == 0:
            srcs = [_pattern(0, block, i) for i in range(count)]
            for i in range(count):
                w.put(1, srcs[i], i * block, signal=0)
            w.flush()
            first_bad = -1
        else:
            first_bad = -1
            for i in range(count):
                w.wait_signal(0, i + 1, timeout=20)
                if first_bad < 0 and not np.array_equal(buf[i * block:(i + 1) * block], _pattern(0, block, i)):
                    first_bad = i
        world.barrier()
    return first_bad


@pytest.mark.parametrize("name", [engine_param("ucx", channels="ucx"), *slow_params("tcp")])
def test_signal_follows_its_data(cluster, name):
    """Large puts (fragmented, several in flight) each signal after their own bytes landed."""
    assert _cluster(cluster, name).run(_data_before_signal, 12, (1 << 20) + 3) == [-1, -1]


def _window_outlives_communicator(world):
    """A window left open when its communicator closes: the teardown releases its keys and
    registrations first (UCX: rkeys before their endpoints, memory before the context), and
    the window refuses later use instead of reaching freed state."""
    buf = np.zeros(4096, np.uint8)
    w = world.window(buf)
    _rma_over_ucx(world, w)
    w.put(1 - world.rank, np.full(4096, 3, np.uint8), signal=0)
    w.flush()
    w.wait_signal(0, 1, timeout=20)
    world.barrier()
    world.close()
    try:
        w.put(1 - world.rank, np.zeros(8, np.uint8))
        w.flush()
    except comm.CommError as e:
        refused = type(e).__name__
    else:
        refused = None
    return bool((buf == 3).all()), refused


@pytest.mark.parametrize("name", [engine_param("ucx", channels="ucx"), "tcp"])
def test_window_left_open_at_communicator_close(name):
    transport, env = SETUPS[name]
    assert run_ranks(_window_outlives_communicator, 2, transport=transport,
                     env=dict(env, COMM_TIMEOUT="20")) == [(True, "Closed")] * 2


# ---- a random sequence of puts and gets against a model ----------------------------------------

def _replay(world, ops, size, allocated=False):
    """ops: (origin, peer, offset, length, is_put, salt). Every rank replays the same list,
    issuing its own, with a fence after each step of 8; the model does the same."""
    n, me = world.size, world.rank
    model = np.zeros((n, size), np.uint8)
    first_bad = -1   # every rank goes on to the end: the fences stay collective
    with world.window(size if allocated else np.zeros(size, np.uint8)) as w:
        buf = w.buffer
        _rma_over_ucx(world, w)
        for step in range(0, len(ops), 8):
            gets = []
            batch = ops[step:step + 8]
            before = model.copy()   # gets read what was there before this step's puts (no races:
            for origin, peer, off, length, is_put, salt in batch:   # a step's ranges are disjoint)
                if is_put:
                    model[peer, off:off + length] = _pattern(origin, length, salt)
                if origin != me:
                    continue
                if is_put:
                    w.put(peer, _pattern(origin, length, salt), off)
                else:
                    dst = np.zeros(length, np.uint8)
                    w.get(peer, dst, off)
                    gets.append((dst, before[peer, off:off + length]))
            w.fence()
            bad = not all(np.array_equal(d, e) for d, e in gets) or not np.array_equal(buf, model[me])
            if bad and first_bad < 0:
                first_bad = step
            world.barrier()   # nobody puts the next step into a window still being checked
    return first_bad


@st.composite
def _sequences(draw, n=2, size=512):
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        used = {p: [] for p in range(n)}   # ranges touched per target this step: kept disjoint
        for _ in range(8):
            origin, peer = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
            off = draw(st.integers(0, size))
            length = draw(st.integers(0, size - off))
            if any(off < b and a < off + length for a, b in used[peer]) or (length == 0 and draw(st.booleans())):
                length = 0
            used[peer].append((off, off + length))
            ops.append((origin, peer, off, length, draw(st.booleans()), draw(st.integers(0, 1000))))
    return ops


@pytest.mark.parametrize("name", ["cma", "shm", engine_param("ucx", channels="ucx"), *slow_params("tcp")])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_sequences())
def test_random_sequences_against_a_model(cluster, name, ops):
    assert _cluster(cluster, name).run(_replay, ops, 512) == [-1, -1]


@pytest.mark.parametrize("name", ["cma", *slow_params("tcp")])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_sequences())
def test_random_sequences_against_a_model_allocated(cluster, name, ops):
    """The same on windows the library allocates: cma maps them (memcpy), tcp sends messages."""
    assert _cluster(cluster, name).run(_replay, ops, 512, True) == [-1, -1]


# ---- torch tensors -------------------------------------------------------------------------------

def _torch_window(world):
    import torch
    n, me = world.size, world.rank
    pool = torch.zeros(4, 16, dtype=torch.bfloat16)
    with world.window(pool) as w:
        block = torch.full((16,), float(me + 1), dtype=torch.bfloat16)
        w.put((me + 1) % n, block, 16 * 2 * me, signal=1)   # row `me` of the peer's pool
        w.flush()
        w.wait_signal(1, 1, timeout=10)
        got = torch.zeros(16, dtype=torch.bfloat16)
        w.get(me, got, 16 * 2 * ((me - 1) % n))
        w.flush()
        ok = bool((pool[(me - 1) % n] == float((me - 1) % n + 1)).all()) and bool((got == pool[(me - 1) % n]).all())
        w.fence()
        pool.resize_(0)   # freed under the window: refused, not written through
        try:
            w.put(me, block)
        except comm.InvalidArgument as e:
            refused = "changed under it" in str(e)
        else:
            refused = False
    return ok, refused


@pytest.mark.slow   # importing torch in the ranks takes 5-10 s here
def test_torch_tensors(cluster):
    pytest.importorskip("torch", reason="torch is not installed")
    assert _cluster(cluster, "cma").run(_torch_window) == [(True, True)] * 2


# ---- refusals: bad input before anything moves, closed windows, timeouts, hostile peers --------

def _refusals(world):
    peer = 1 - world.rank
    buf = np.full(64, 9, np.uint8)
    errors = []
    w = world.window(buf, signals=2)
    _rma_over_ucx(world, w)

    def refused(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except comm.InvalidArgument as e:
            errors.append(e.op)
        else:
            errors.append(None)

    refused(w.put, peer, np.zeros(8, np.uint8), 60)        # past the end
    refused(w.put, peer, np.zeros(65, np.uint8))            # larger than the window
    refused(w.put, peer, np.zeros(1, np.uint8), -1)         # negative offset
    refused(w.put, 2, np.zeros(1, np.uint8))                # no such rank
    refused(w.put, peer, np.zeros(1, np.uint8), signal=2)   # no such signal
    refused(w.get, peer, np.zeros(1, np.uint8), 64)
    refused(w.get, peer, np.zeros(4, np.uint8)[::2])        # not contiguous
    refused(w.wait_signal, 5, 1)
    refused(w.wait_signal, 0, -1)
    t0, timed_out = time.monotonic(), False
    try:
        w.wait_signal(0, 1, timeout=0.3)
    except comm.CommTimeout as e:
        timed_out = "wait_signal" in str(e) and time.monotonic() - t0 < 3
    w.fence()   # still usable after all of that
    untouched = bool((buf == 9).all())
    w.close()
    try:
        w.put(peer, np.zeros(1, np.uint8))
    except comm.Closed:
        closed = True
    world.barrier()
    return errors, timed_out, untouched, closed


@pytest.mark.parametrize("name", ["cma", "tcp", engine_param("ucx", channels="ucx")])
def test_refusals(cluster, name):
    ops = ["put"] * 5 + ["get", "get", "wait_signal", "wait_signal"]
    assert _cluster(cluster, name).run(_refusals) == [(ops, True, True, True)] * 2


def _hostile(world):
    """Rank 0's engine is told rank 1's window is larger than it is, and that a closed window
    is open (as a buggy or hostile peer would act): rank 1's engine refuses, writes nothing,
    and rank 0's flush names rank 1 and why."""
    from comm import _native, checks
    me = world.rank
    guard = np.full(96, 5, np.uint8)
    window = guard[16:48]   # 32 bytes; the rest must never change
    s = world.session
    tw = s.transport.window(checks.buffer(s, window, "window", writable=True, what="window"), 4)
    result = None
    world.barrier()
    if me == 0:
        lie = [(0, 1 << 20, 0, 0, -1)] * 2
        w = _native.window(world.session.transport._engine, 0, 0, 4)
        lie[1] = (0, 1 << 20, tw.peers[1][2], os.getpid(), -1)   # rank 1's true window id
        w.connect(lie)
        w.put(1, np.zeros(64, np.uint8).ctypes.data, 64, 8, -1)   # 64 bytes at 8: past 32
        try:
            w.flush(1, 10.0)
        except comm.InvalidArgument as e:   # the target named by its rank
            result = ("outside its window" in str(e), 1 if "rank 1 refused" in e.cause else None)
        w.close()
    world.barrier()
    tw.close()
    world.barrier()
    if me == 0:   # rank 1's window is closed now: a put into it is refused too
        w = _native.window(world.session.transport._engine, 0, 0, 4)
        w.connect([(0, 64, 0, 0, -1), (0, 64, tw.peers[1][2], os.getpid(), -1)])
        w.put(1, np.zeros(8, np.uint8).ctypes.data, 8, 0, -1)
        try:
            w.flush(1, 10.0)
        except comm.InvalidArgument as e:
            result = result + ("no such window" in str(e),)
        w.close()
    world.barrier()
    return result, bool((guard == 5).all())


@pytest.mark.parametrize("name", ["tcp", "shm"])
def test_target_refuses_what_its_origin_should_not_send(cluster, name):
    assert _cluster(cluster, name).run(_hostile) == [((True, 1, True), True), (None, True)]


def _put_to_dead_peer(world, allocated=False):
    w = world.window(1 << 20 if allocated else np.zeros(1 << 20, np.uint8))
    _rma_over_ucx(world, w)
    world.barrier()
    if world.rank == 1:
        os._exit(0)   # gone without a word
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        for _ in range(50):
            w.put(1, np.ones(1 << 20, np.uint8), signal=0)
        w.flush()
    except comm.PeerFailure as e:
        return type(e).__name__, e.peer, time.monotonic() - t0 < 15
    except comm.CommError as e:
        return type(e).__name__, str(e), time.monotonic() - t0 < 15
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("name", [*SETUPS, "mapped"])
def test_put_to_dead_peer_fails_within_the_timeout(name):
    """mapped: an allocated window on one host, where a put is a store into the dead peer's
    memory (it cannot fail): the flush finds the peer gone."""
    transport, env = SETUPS["cma" if name == "mapped" else name]
    c = Cluster(2, transport, env=dict(env, COMM_TIMEOUT="10"))
    try:
        c.submit(_put_to_dead_peer, name == "mapped")
        out = c.collect([0], timeout=60)
    finally:
        c.close()
    ok, value, _ = out[0]
    assert ok and value == ("PeerFailure", 1, True), value


def _closed_communicator(world):
    buf = np.zeros(8, np.uint8)
    w = world.window(buf)
    world.revoke()
    try:
        w.put(0, np.zeros(1, np.uint8))
    except comm.Revoked:
        return True
    return False


def test_revoked_communicator_refuses_its_windows():
    assert run_ranks(_closed_communicator, 2, timeout=60) == [True, True]


def _all_pairs(world, allocated=False):
    """Every rank puts into every other's window, with a signal: peers outside the engine's
    plan (not connected at set-up) are connected on first use. allocated: windows the library
    allocates, mapped by the peers on the same host, messages to the other host."""
    before = sorted(world.session.transport.connected_peers())
    nbytes = 8 * world.size
    with world.window(nbytes if allocated else np.zeros(nbytes, np.uint8), signals=1) as w:
        buf = w.buffer
        for p in range(world.size):
            if p != world.rank:
                w.put(p, np.full(8, world.rank + 1, np.uint8), 8 * world.rank, signal=0)
        w.wait_signal(0, world.size - 1, timeout=30)
        w.flush()
        ok = all((buf[8 * r:8 * r + 8] == (r + 1 if r != world.rank else 0)).all() for r in range(world.size))
    return ok, len(before)


@pytest.mark.slow
@pytest.mark.parametrize("allocated", [False, True], ids=["user", "allocated"])
def test_window_peers_are_connected_on_first_use(allocated):
    from bench.cluster import NetnsCluster, unavailable
    if unavailable():
        pytest.skip(str(unavailable()))
    placement = [0, 0, 0, 0, 1, 1, 1, 1]   # 2 hosts x 4: rank 1's plan is 0, 2, 3 and 5 only
    with NetnsCluster(2) as hosts:
        c = Cluster(len(placement), netns=[hosts.ns[h] for h in placement], timeout=120,
                    env={"MASTER_ADDR": hosts.addr(0), "COMM_TIMEOUT": "60", "COMM_CONNECT": "lazy"})
        try:
            out = c.run(_all_pairs, allocated, timeout=240)
        finally:
            c.close()
    assert all(ok for ok, _ in out), out
    assert min(k for _, k in out) < len(placement) - 1, f"every rank was connected to every peer at set-up: {out}"


# ---- windows the library allocates: world.window(nbytes) -------------------------------------------

def _window_mappings():
    """How many mappings of window memory (allocated windows, its own and its peers') this
    process has: the memfd's name shows in /proc/self/maps."""
    with open("/proc/self/maps") as f:
        return sum("comm-window-memory" in line for line in f)


def _allocated_edges(world):
    """Even ranks allocate their windows, odd ranks expose an array (both at once is allowed):
    rank r writes rank r+1's window (whole, last byte, 0 bytes at the end, a notification,
    then 100 small puts in flight with a signal each) and reads every window back."""
    n, me = world.size, world.rank
    size = 4096 + 8 * me
    own = None if me % 2 == 0 else np.zeros(size, np.uint8)
    written = {}
    for p in range(n):   # what rank p's window holds at the end
        w_ = _pattern((p - 1) % n, 4096 + 8 * p, 1)
        w_[-1] = 200 + (p - 1) % n
        w_[:800] = _pattern((p - 1) % n, 800, 2)
        written[p] = w_
    with world.window(size if own is None else own, signals=4) as w:
        fresh = w.buffer.dtype == np.uint8 and w.buffer.shape == (size,) and not w.buffer.any()
        assert (w.buffer is own) if own is not None else fresh
        assert w.sizes == tuple(4096 + 8 * p for p in range(n))
        world.barrier()
        p = (me + 1) % n
        w.put(p, _pattern(me, w.sizes[p], 1))
        w.put(p, np.full(1, 200 + me, np.uint8), w.sizes[p] - 1)
        w.put(p, np.zeros(0, np.uint8), w.sizes[p])
        w.put(p, np.zeros(0, np.uint8), signal=3)
        w.flush(p)   # the whole-window put lands before the small ones below overwrite it
        small = _pattern(me, 800, 2)
        for i in range(100):
            w.put(p, small[8 * i:8 * i + 8], 8 * i, signal=1)
        w.flush()
        w.wait_signal(3, 1, timeout=10)
        w.wait_signal(1, 100, timeout=10)
        signals = [w.signal(k) for k in range(4)]
        world.barrier()
        mine = bool(np.array_equal(w.buffer, written[me]))
        back = [_reads_back(w, p, written[p]) for p in range(n)]
        w.fence()
    return mine, back, signals


@pytest.mark.parametrize("name", ["cma", "shm", "tcp", *slow_params("ucx")])
def test_allocated_windows_edges(cluster, name):
    """cma: mapped peers (and CMA into the odd rank's array); shm: mapped peers and shm-ring
    messages into the array (no CMA); tcp and ucx: the message path everywhere."""
    n = 3
    assert _cluster(cluster, name, n).run(_allocated_edges) == [(True, [True] * n, [0, 100, 0, 1])] * n


@pytest.mark.parametrize("count, block", [(200, 96), (2, (2 << 20) + 5)], ids=["many", "large"])
def test_allocated_many_and_large_puts(cluster, count, block):
    n = 3
    assert _cluster(cluster, "cma", n).run(_many, count, block, True) == [(True, [count] * n)] * n


def _allocated_close(world):
    """A window's mappings live until close(): then this rank's mappings of its peers' windows
    are gone (it cannot write into them any more), its own memory stays while an array taken
    from w.buffer holds it, and goes with that array."""
    me, peer = world.rank, 1 - world.rank
    base = _window_mappings()
    w = world.window(4096, signals=1)
    mapped = _window_mappings() - base   # its own and its peer's
    mem = w.buffer
    w.put(peer, np.full(8, 5 + me, np.uint8), 8, signal=0)
    w.flush()
    w.wait_signal(0, 1, timeout=10)
    w.close()
    after_close = _window_mappings() - base
    kept = bool((mem[8:16] == 5 + peer).all())
    refused = []
    for call in (lambda: w.put(peer, np.zeros(1, np.uint8)), lambda: w.flush(), lambda: w.buffer):
        try:
            call()
        except comm.Closed:
            refused.append(True)
        else:
            refused.append(False)
    del mem
    import gc
    gc.collect()
    return mapped, after_close, kept, refused, _window_mappings() - base


def test_allocated_window_close(cluster):
    assert _cluster(cluster, "cma").run(_allocated_close) == [(2, 1, True, [True] * 3, 0)] * 2


def _one_rank_cannot(world):
    """Rank 1 asks for more memory than the host has, then for a bad signal count, then for a
    window it cannot map (its address space is capped): every rank raises InvalidArgument at
    once, nothing is allocated past what the host has (no OOM killer), and the communicator
    goes on."""
    import resource
    import time
    out = []
    soft_as = resource.getrlimit(resource.RLIMIT_AS)
    for case in ("memory", "signals", "map"):
        t0 = time.monotonic()
        try:
            if case == "map" and world.rank == 1:
                with open("/proc/self/status") as f:
                    vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
                resource.setrlimit(resource.RLIMIT_AS, (vm + (32 << 20), soft_as[1]))
            ask = {"memory": 1 << 50, "signals": 4096, "map": 256 << 20}[case] if world.rank == 1 else 4096
            try:
                world.window(ask, signals=-1 if case == "signals" and world.rank == 1 else 4)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, soft_as)
            out.append("made")
        except comm.InvalidArgument as e:
            named = ("more than this host's available memory" if world.rank == 1 else "rank 1") if case == "memory" \
                else ("signals=-1" if world.rank == 1 else "rank 1") if case == "signals" \
                else ("mmap" if world.rank == 1 else "rank 1 could not make its window")
            out.append(named in str(e) and time.monotonic() - t0 < 10)
    x = np.ones(4)
    world.all_reduce(x)
    return out, float(x[0])


def test_window_one_rank_cannot(cluster):
    assert _cluster(cluster, "cma").run(_one_rank_cannot) == [([True] * 3, 2.0)] * 2


def _page_kib(addr: int) -> int:
    """The kernel page size (KiB) of the mapping holding addr (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0] if line.strip() else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("KernelPageSize:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _allocated_large(world):
    """A window of several MiB: on 2 MiB pages where the host has a pool of them, else on
    small pages; either way a put past the first huge page lands where it should."""
    n = 5 << 20
    w = world.window(n)
    page = _page_kib(w.buffer.ctypes.data)
    peer = left = 1 - world.rank
    w.put(peer, (np.arange(n - 4097, dtype=np.int64) % 251 + world.rank).astype(np.uint8), 4097)
    w.flush()
    w.fence()
    want = (np.arange(n - 4097, dtype=np.int64) % 251 + left).astype(np.uint8)
    ok = bool((w.buffer[4097:] == want).all() and not w.buffer[:4097].any())
    w.close()
    return page, ok


def _huge_pages_free() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("HugePages_Free:"))


def test_allocated_window_page_size(cluster):
    pool = _huge_pages_free()
    results = _cluster(cluster, "cma").run(_allocated_large)
    assert all(ok for _, ok in results), results
    if pool >= 2 * 3:   # 3 pages a window, beside whatever else took pages meanwhile
        assert [page for page, _ in results] == [2048, 2048], results
    else:
        print(f"no pool of 2 MiB pages here (HugePages_Free {pool}): checked the small-page path only")
        assert all(page in (4, 2048) for page, _ in results), results


def _allocated_refusals(world):
    """Bad sizes refuse the window before any exchange; bad puts / gets on an allocated window
    are refused (the lean native call hands them to the full checks) before a byte moves."""
    peer = 1 - world.rank
    errors = []

    def refused(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except comm.InvalidArgument as e:
            errors.append((e.op, e.rank))
        else:
            errors.append(None)

    for bad in (True, -1, 2.5, np.float32(1.0), np.int64(-8)):
        refused(world.window, bad)
    w = world.window(np.int32(64), signals=2)   # numpy's ints are ints
    src = np.full(8, 7, np.uint8)
    refused(w.put, peer, src, 60)               # past the end
    refused(w.put, peer, np.zeros(65, np.uint8))
    refused(w.put, peer, src, -1)
    refused(w.put, True, src)                   # a bool is no rank
    refused(w.put, peer, src, 1.0)              # nor an offset
    refused(w.put, 2, src)
    refused(w.put, peer, src, signal=2)
    refused(w.put, peer, src, signal=-1)
    refused(w.put, peer, np.zeros(16, np.uint8)[::2])
    refused(w.get, peer, np.zeros(4, np.uint8), 62)
    readonly = np.zeros(4, np.uint8)
    readonly.flags.writeable = False
    refused(w.get, peer, readonly)
    refused(w.flush, 2)
    w.fence()
    untouched = not w.buffer.any() and w.signal(0) == 0 and w.signal(1) == 0
    w.close()
    return errors, untouched


def test_allocated_window_refusals(cluster):
    out = _cluster(cluster, "cma").run(_allocated_refusals)
    for rank, (errors, untouched) in enumerate(out):
        assert errors == [("window", rank)] * 5 + [("put", rank)] * 9 + [("get", rank)] * 2 + [("flush", rank)]
        assert untouched


def _allocated_empty(world):
    """0 bytes on one rank: its window is empty, a put into it is a pure notification."""
    me, peer = world.rank, 1 - world.rank
    with world.window(0 if me == 0 else 16, signals=1) as w:
        empty = w.buffer.shape == ((0,) if me == 0 else (16,)) and w.sizes == (0, 16)
        w.put(peer, np.zeros(0 if peer == 0 else 16, np.uint8), 0, signal=0)
        w.flush()
        w.wait_signal(0, 1, timeout=10)
        try:
            w.put(0, np.zeros(1, np.uint8))
        except comm.InvalidArgument:
            refused = True
        else:
            refused = False
        w.fence()
    return empty, refused


def test_allocated_window_of_0_bytes(cluster):
    assert _cluster(cluster, "cma").run(_allocated_empty) == [(True, True)] * 2


def _allocated_torch(world):
    import torch
    me, peer = world.rank, 1 - world.rank
    with world.window(4 * 16 * 2, signals=1) as w:
        pool = torch.from_numpy(w.buffer).view(torch.bfloat16).view(4, 16)   # no copy
        block = torch.full((16,), float(me + 1), dtype=torch.bfloat16)
        w.put(peer, block, 16 * 2 * me, signal=0)   # a tensor as the source (the lean path)
        w.flush()
        w.wait_signal(0, 1, timeout=10)
        seen = bool((pool[peer] == float(peer + 1)).all())
        pool[3] = 9.0   # written through the tensor: the peer reads it from its mapping
        world.barrier()
        got = torch.zeros(16, dtype=torch.bfloat16)
        w.get(peer, got, 16 * 2 * 3)
        w.flush()
        w.fence()
        return seen, bool((got == 9.0).all())


@pytest.mark.slow   # importing torch in the ranks takes 5-10 s here
def test_allocated_window_torch(cluster):
    pytest.importorskip("torch", reason="torch is not installed")
    assert _cluster(cluster, "cma").run(_allocated_torch) == [(True, True)] * 2


@pytest.mark.slow
def test_ucx_rma_across_hosts():
    """UCX across two simulated hosts (TCP, with UCX's peer-failure handling on): the RMA path
    (emulated over TCP) with the edges, data before signal and a target that sleeps."""
    from bench.cluster import NetnsCluster, unavailable
    if unavailable():
        pytest.skip(str(unavailable()))
    pytest.importorskip("libucx", reason="the libucx wheel is not installed")
    with NetnsCluster(2) as hosts:
        c = Cluster(2, "ucx", netns=[hosts.ns[0], hosts.ns[1]], timeout=120,
                    env={"MASTER_ADDR": hosts.addr(0), "COMM_TIMEOUT": "30", "COMM_WINDOW_RMA": "1"})
        try:
            edges = c.run(_edges, timeout=120)
            ordered = c.run(_data_before_signal, 6, (1 << 20) + 3, timeout=120)
            sleeps = c.run(_target_sleeps, timeout=120)
        finally:
            c.close()
    assert edges == [True, True] and ordered == [-1, -1] and sleeps == [(True, True), (True, 1)]

