"""The conformance suite: the same semantics checked on every transport available here.

Each check runs on real rank processes; every rank builds every rank's input from the case
seed, so each rank verifies its own result against the numpy reference (tests/reference.py)
and returns a list of problems (empty when all is well).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comm
from comm.core.ops import OpKind
from comm.core.types import DType, ReduceOp
from harness import assert_no_problems, slow, transport_params
from reference import (ALL_DTYPES, dtypes, empty, make, mismatch, ops_for, reduce, reduce_scatter_v,
                       v_counts, values)

SIZES = [0, 1, 1001, 300_001]          # 300_001 float32 crosses the native chunk size


@pytest.fixture(params=transport_params())
def transport(request):
    return request.param


def _run(cluster, transport, n, fn, *args, timeout=300):
    name, launcher = transport
    assert_no_problems(cluster(n, name, launcher).run(fn, *args, timeout=timeout))


# ---- rank-side checks -------------------------------------------------------------------------

def check_all_reduce(world, dtypes, sizes, kind="numpy"):
    problems = []
    for dtype in dtypes:
        for op in ops_for(dtype):
            for count in sizes:
                for inplace in (True, False):
                    seed = count * 31 + int(op)
                    ins = [values(dtype, count, r, seed, op) for r in range(world.size)]
                    x = make(ins[world.rank], dtype, kind)
                    scale = 0.5 if op is ReduceOp.PREMUL_SUM else None
                    out = None if inplace else empty(count, dtype, kind)
                    world.all_reduce(x, op=op, out=out, scale=scale)
                    want = reduce(ins, op, dtype, 0.5)
                    what = f"all_reduce {dtype.name} {op.name} n={count} {'in' if inplace else 'out-of'}-place"
                    p = mismatch(x if inplace else out, want, dtype, what)
                    if not inplace and p is None:
                        p = mismatch(x, ins[world.rank], dtype, what + " (input changed)")
                    if p:
                        problems.append(f"rank {world.rank}: {p}")
    return problems


def check_reduce_scatter_all_gather(world, dtypes, sizes):
    problems, n = [], world.size
    for dtype in dtypes:
        for count in sizes:
            for op in (ReduceOp.SUM, ReduceOp.MAX) if dtype is not DType.BOOL else (ReduceOp.SUM,):
                ins = [values(dtype, count * n, r, count + int(op), op) for r in range(n)]
                out = empty(count, dtype)
                world.reduce_scatter(out, make(ins[world.rank], dtype), op=op)
                want = reduce(ins, op, dtype)[world.rank * count:(world.rank + 1) * count]
                p = mismatch(out, want, dtype, f"reduce_scatter {dtype.name} {op.name} n={count}")
                problems += [p] if p else []
            ins = [values(dtype, count, r, 7 + count) for r in range(n)]
            out = empty(count * n, dtype)
            world.all_gather(out, make(ins[world.rank], dtype))
            p = mismatch(out, np.concatenate(ins), dtype, f"all_gather {dtype.name} n={count}")
            problems += [p] if p else []
            # in place: the input is this rank's slot of the output
            out = make(np.concatenate([ins[r] if r == world.rank else np.zeros(count) for r in range(n)]), dtype)
            world.all_gather(out, out[world.rank * count:(world.rank + 1) * count])
            p = mismatch(out, np.concatenate(ins), dtype, f"all_gather in-place {dtype.name} n={count}")
            problems += [p] if p else []
    return problems


def check_rooted(world, dtypes, sizes):
    problems, n = [], world.size
    for dtype in dtypes:
        for count in sizes:
            for root in sorted({0, n - 1, n // 2}):
                ins = [values(dtype, count, r, root + count) for r in range(n)]
                x = make(ins[world.rank], dtype)
                world.broadcast(x, root=root)
                p = mismatch(x, ins[root], dtype, f"broadcast {dtype.name} n={count} root={root}")
                problems += [p] if p else []

                x = make(ins[world.rank], dtype)
                out = empty(count, dtype) if world.rank == root else None
                world.reduce(x, root=root, out=out)
                if world.rank == root:
                    p = mismatch(out, reduce(ins, ReduceOp.SUM, dtype), dtype, f"reduce {dtype.name} n={count} root={root}")
                    problems += [p] if p else []
                p = mismatch(x, ins[world.rank], dtype, f"reduce input changed root={root}")
                problems += [p] if p else []

                out = empty(count * n, dtype) if world.rank == root else None
                world.gather(out, make(ins[world.rank], dtype), root=root)
                if world.rank == root:
                    p = mismatch(out, np.concatenate(ins), dtype, f"gather {dtype.name} n={count} root={root}")
                    problems += [p] if p else []

                big = [values(dtype, count * n, r, 3 + root) for r in range(n)]
                out = empty(count, dtype)
                world.scatter(out, make(big[root], dtype) if world.rank == root else None, root=root)
                p = mismatch(out, big[root][world.rank * count:(world.rank + 1) * count], dtype,
                             f"scatter {dtype.name} n={count} root={root}")
                problems += [p] if p else []
    return problems


def splits_for(n: int, seed: int, row_max: int = 5) -> np.ndarray:
    """splits[i][j]: rows rank i sends to rank j (zeros included)."""
    return np.random.default_rng(seed).integers(0, row_max, (n, n))


def check_all_to_all(world, dtypes, row_width):
    problems, n, r = [], world.size, world.rank
    for dtype in dtypes:
        # even blocks, 2-D rows
        rows = 3 * n
        ins = [values(dtype, rows * row_width, q, 11).reshape(rows, row_width) for q in range(n)]
        out = empty(None, dtype, shape=(rows, row_width))
        world.all_to_all(out, make(ins[r], dtype))
        want = np.concatenate([ins[q][r * 3:(r + 1) * 3] for q in range(n)])
        p = mismatch(out, want, dtype, f"all_to_all {dtype.name} even")
        problems += [p] if p else []
        # uneven splits, some empty
        for seed in range(3):
            s = splits_for(n, seed)
            ins = [values(dtype, int(s[q].sum()) * row_width, q, seed).reshape(-1, row_width) for q in range(n)]
            out = empty(None, dtype, shape=(int(s[:, r].sum()), row_width))
            world.all_to_all(out, make(ins[r], dtype), out_splits=list(s[:, r]), in_splits=list(s[r]))
            want = np.concatenate([ins[q][s[q, :r].sum():s[q, :r + 1].sum()] for q in range(n)])
            p = mismatch(out, want, dtype, f"all_to_all_v {dtype.name} seed={seed} splits={s.tolist()}")
            problems += [p] if p else []
    return problems


_EVERY_OP = (DType.FLOAT32, DType.BFLOAT16, DType.INT64, DType.BOOL)


def check_v_collectives(world, dtypes, most, seeds=(0, 1), every_op=True):
    """all_gather_v / reduce_scatter_v (and their persistent forms) with uneven counts,
    zeros included, every op of every dtype; or, on a transport without them, the refusal."""
    problems, n, r = [], world.size, world.rank
    if not world.session.transport.kinds >= {OpKind.ALL_GATHER_V, OpKind.REDUCE_SCATTER_V}:
        for call in (lambda: world.all_gather_v(np.zeros(1), np.zeros(1), [1] * n),
                     lambda: world.reduce_scatter_v(np.zeros(1), np.zeros(n), [1] * n)):
            try:
                call()
                problems.append(f"rank {r}: {world.transport} ran a v-collective it does not list")
            except comm.TransportUnavailable as e:
                if "does not support" not in str(e):
                    problems.append(f"rank {r}: unclear refusal: {e}")
        return problems
    for seed in seeds:
        counts = v_counts(n, seed, most)
        total, start = sum(counts), sum(counts[:r])
        for dtype in dtypes:
            every = every_op and seed and dtype in _EVERY_OP   # the kernels are reduce_scatter's
            for op in ops_for(dtype) if every else [ReduceOp.SUM]:
                scale = 0.5 if op is ReduceOp.PREMUL_SUM else None
                ins = [values(dtype, total, q, seed + 17 * int(op), op) for q in range(n)]
                out = empty(counts[r], dtype)
                world.reduce_scatter_v(out, make(ins[r], dtype), counts, op=op, scale=scale)
                p = mismatch(out, reduce_scatter_v(ins, counts, r, op, dtype, 0.5), dtype,
                             f"reduce_scatter_v {dtype.name} {op.name} counts={counts}")
                problems += [f"rank {r}: {p}"] if p else []
            ins = [values(dtype, counts[q], q, seed) for q in range(n)]
            out = empty(total, dtype)
            world.all_gather_v(out, make(ins[r], dtype), counts)
            p = mismatch(out, np.concatenate(ins), dtype, f"all_gather_v {dtype.name} counts={counts}")
            problems += [f"rank {r}: {p}"] if p else []
        if not every_op:
            continue
        # rows of 3; in place (the input is this rank's block of the output); persistent forms
        rows = [values(DType.FLOAT32, 3 * counts[q], q, 5).reshape(-1, 3) for q in range(n)]
        out = make(np.concatenate([rows[q] if q == r else np.zeros((counts[q], 3)) for q in range(n)]),
                   DType.FLOAT32)
        world.all_gather_v(out, out[start:start + counts[r]], counts)
        p = mismatch(out, np.concatenate(rows), DType.FLOAT32, f"all_gather_v in place counts={counts}")
        problems += [f"rank {r}: {p}"] if p else []
        gather = world.all_gather_v_init(out := empty(None, DType.FLOAT32, shape=(total, 3)),
                                         make(rows[r], DType.FLOAT32), counts)
        big = [values(DType.INT32, 3 * total, q, 9).reshape(-1, 3) for q in range(n)]
        scattered = empty(None, DType.INT32, shape=(counts[r], 3))
        scatter = world.reduce_scatter_v_init(scattered, make(big[r], DType.INT32), counts, op=ReduceOp.MAX)
        for _ in range(2):
            gather()
            scatter.start()
            scatter.wait()
            p = mismatch(out, np.concatenate(rows), DType.FLOAT32, f"all_gather_v_init counts={counts}")
            p = p or mismatch(scattered, reduce(big, ReduceOp.MAX, DType.INT32)[start:start + counts[r]],
                              DType.INT32, f"reduce_scatter_v_init counts={counts}")
            problems += [f"rank {r}: {p}"] if p else []
        gather.close()
        scatter.close()
    return problems


def check_p2p(world):
    problems, r, n = [], world.rank, world.size
    if n < 2:
        return problems
    # tag matching: rank 0 sends tags 1 then 2; rank 1 receives tag 2 first
    if r == 0:
        w1 = world.isend(np.full(10, 1.0), 1, tag=1)
        w2 = world.isend(np.full(20, 2.0), 1, tag=2)
        w1.wait()
        w2.wait()
    elif r == 1:
        a, b = np.zeros(20), np.zeros(10)
        world.recv(a, 0, tag=2)
        world.recv(b, 0, tag=1)
        if not (a == 2).all() or not (b == 1).all():
            problems.append("tag matching: wrong payloads")
    # ordering within one (peer, tag), around a ring
    right, left = (r + 1) % n, (r - 1) % n
    sends = [world.isend(np.full(100, float(i + 100 * r)), right, tag=7) for i in range(5)]
    for i in range(5):
        buf = np.zeros(100)
        world.recv(buf, left, tag=7)
        if not (buf == i + 100 * left).all():
            problems.append(f"rank {r}: message {i} from {left} out of order: {buf[0]}")
    for w in sends:
        w.wait()
    # large message
    big = np.arange(1 << 20, dtype=np.float32) + r
    got = np.zeros_like(big)
    ws = world.isend(big, right, tag=3)
    world.recv(got, left, tag=3)
    ws.wait()
    if not (got == np.arange(1 << 20, dtype=np.float32) + left).all():
        problems.append(f"rank {r}: large p2p wrong")
    return problems


def check_split_and_async(world):
    problems, r, n = [], world.rank, world.size
    sub = world.split(r % 2, key=-r)          # reverse order inside each group
    members = [q for q in range(n) if q % 2 == r % 2]
    if sub.size != len(members) or sub.rank != sorted(members, reverse=True).index(r):
        problems.append(f"rank {r}: split gave rank {sub.rank} of {sub.size}")
    x = np.full(5000, float(r))
    w = sub.all_reduce(x, async_op=True)
    y = np.full(7000, float(r))
    wy = world.all_reduce(y, async_op=True)  # both groups busy at once
    w.wait()
    wy.wait()
    if not (x == sum(members)).all():
        problems.append(f"rank {r}: sub-group all_reduce got {x[0]}, want {sum(members)}")
    if not (y == n * (n - 1) / 2).all():
        problems.append(f"rank {r}: world all_reduce during split got {y[0]}")
    none = world.split(None if r == 0 else 1)
    if (none is None) != (r == 0):
        problems.append(f"rank {r}: color None handling")
    # several async ops in flight, completed in order
    bufs = [np.full(1 << 16, float(i + r)) for i in range(6)]
    works = [world.all_reduce(b, async_op=True) for b in bufs]
    _ = np.linalg.norm(np.ones((200, 200)) @ np.ones((200, 200)))  # overlap some compute
    for i, (w, b) in enumerate(zip(works, bufs)):
        w.wait()
        if not w.is_completed() or not (b == n * i + n * (n - 1) / 2).all():
            problems.append(f"rank {r}: async all_reduce {i} wrong")
    world.barrier()
    for c in (sub, none):
        if c is not None:
            c.close()
    return problems


def check_large(world, mib):
    n = world.size
    x = np.full(mib << 18, float(world.rank + 1), dtype=np.float32)
    world.all_reduce(x)
    want = n * (n + 1) / 2
    return [] if (x == want).all() else [f"rank {world.rank}: {mib} MiB all_reduce wrong: {x[:3]}"]


def check_case(world, kind, dtype, count, op, root):
    """One hypothesis case: a collective on random-size data against numpy."""
    dtype, op = DType(dtype), ReduceOp(op)
    n, r = world.size, world.rank
    ins = [values(dtype, count, q, count ^ int(op), op) for q in range(n)]
    x = make(ins[r], dtype)
    if kind == "all_reduce":
        world.all_reduce(x, op=op, scale=0.5 if op is ReduceOp.PREMUL_SUM else None)
        p = mismatch(x, reduce(ins, op, dtype, 0.5), dtype, f"all_reduce {dtype.name} {op.name} {count}")
    elif kind == "reduce":
        world.reduce(x, root=root, op=op, scale=0.5 if op is ReduceOp.PREMUL_SUM else None)
        want = reduce(ins, op, dtype, 0.5) if r == root else ins[r]
        p = mismatch(x, want, dtype, f"reduce {dtype.name} {op.name} {count} root {root}")
    else:
        world.broadcast(x, root=root)
        p = mismatch(x, ins[root], dtype, f"broadcast {dtype.name} {count} root {root}")
    return [p] if p else []


# ---- tests ---------------------------------------------------------------------------------------

# Quick: 2 ranks. A group of one is quick through the other collectives, the v forms and the
# property test below; 3 ranks (odd, not a power of two) through them too, and through every
# native algorithm forced (test_native_algorithms).
@pytest.mark.parametrize("n", [2, *slow(1, 3, 4, 5)])
def test_all_reduce(cluster, transport, n):
    sizes = SIZES if n <= 3 else SIZES[:3]
    _run(cluster, transport, n, check_all_reduce, ALL_DTYPES, sizes)


@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_torch_tensors(cluster, transport, n):
    pytest.importorskip("torch")
    _run(cluster, transport, n, check_all_reduce, ALL_DTYPES, [0, 1, 1001], "torch")


@pytest.mark.parametrize("n", [1, 2, 3, *slow(4)])
def test_reduce_scatter_all_gather(cluster, transport, n):
    _run(cluster, transport, n, check_reduce_scatter_all_gather, ALL_DTYPES, [0, 1, 1001, 70_001])


@pytest.mark.parametrize("n", [1, 2, 3, *slow(5)])
def test_broadcast_reduce_gather_scatter(cluster, transport, n):
    _run(cluster, transport, n, check_rooted, dtypes(DType.FLOAT32, DType.BFLOAT16, DType.INT64, DType.UINT8),
         [0, 1, 1001, 300_001] if n <= 3 else [0, 1, 1001])


@pytest.mark.parametrize("n", [1, 2, 3, *slow(4)])
def test_all_to_all(cluster, transport, n):
    _run(cluster, transport, n, check_all_to_all, [DType.FLOAT32, DType.FLOAT16, DType.INT32], 3)


@pytest.mark.parametrize("n", [1, 3])
def test_v_collectives(cluster, transport, n):
    _run(cluster, transport, n, check_v_collectives,
         ALL_DTYPES if n > 1 else dtypes(DType.FLOAT32, DType.BFLOAT16), 1001)


def test_v_collectives_large(cluster, transport):
    """Blocks past the direct path: single-copy (cma) on one host, the ring over the other channels."""
    _run(cluster, transport, 2, check_v_collectives, [DType.FLOAT32], 3_000_001, (1,), False)


@pytest.mark.parametrize("n", [2, 3, *slow(4)])
def test_send_recv(cluster, transport, n):
    _run(cluster, transport, n, check_p2p)


@pytest.mark.parametrize("n", [3, *slow(4)])
def test_split_groups_and_async(cluster, transport, n):
    _run(cluster, transport, n, check_split_and_async)


def test_all_reduce_64mib(cluster, transport):
    _run(cluster, transport, 2, check_large, 64)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.sampled_from([1, 2, 3]), kind=st.sampled_from(["all_reduce", "reduce", "broadcast"]),
       dtype=st.sampled_from(ALL_DTYPES), count=st.integers(0, 5000), data=st.data())
def test_property_against_numpy(cluster, transport, n, kind, dtype, count, data):
    op = data.draw(st.sampled_from(ops_for(dtype)))
    root = data.draw(st.integers(0, n - 1))
    _run(cluster, transport, n, check_case, kind, int(dtype), count, int(op), root)
