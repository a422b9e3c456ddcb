"""comm.algorithms on the in-process thread transport (tests/inproc.py), against numpy.

Every algorithm runs on 1..9 ranks, every dtype and op, sizes 0, 1, odd and several chunks
long (the chunk is made tiny so a few dozen elements cross many chunk boundaries).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc import run_threads
from reference import ALL_DTYPES, as_f64, dtypes, empty, make, mismatch, ops_for, reduce, values

from comm.algorithms import collective_tag, run
from comm.algorithms import reduce as kernels
from comm.algorithms.topology import (
    binomial_children,
    binomial_parent,
    rd_fold,
    rd_partners,
    rd_real_rank,
    segment_bounds,
)
from comm.buffers import as_buffer
from comm.errors import CommTimeout, Mismatch
from comm.types import DType, ReduceOp
from transports.base import OpDesc, OpKind

RANKS = range(1, 10)
SIZES = [0, 1, 7, 37]
CHUNK_BYTES = 16          # 37 float64 elements span 19 chunks
FLOATS = dtypes(DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)


class Caller:
    """Builds the OpDesc a Communicator would build and runs it through comm.algorithms.run."""

    def __init__(self, p2p, algo=None, chunk_bytes=CHUNK_BYTES):
        self.p2p, self.algo, self.chunk_bytes, self.seq = p2p, algo, chunk_bytes, 0
        self.rank, self.size = p2p.rank, p2p.size

    def __call__(self, kind, send=None, recv=None, *, dtype=DType.UINT8, count=0, op=ReduceOp.SUM,
                 scale=1.0, root=0, send_counts=None, recv_counts=None):
        self.seq += 1
        buf = lambda x: None if x is None else as_buffer(x, op=kind.label, writable=True)
        desc = OpDesc(kind, buf(send), buf(recv), dtype, count, op, scale, root,
                      send_counts=send_counts, recv_counts=recv_counts)
        run(desc, self.p2p, seq=self.seq, timeout=30, chunk_bytes=self.chunk_bytes, algo=self.algo)


def _check(problems, got, want, dtype, what):
    if not dtype.is_floating and dtype is not DType.BOOL:  # 9 ranks overflow int8/uint8: it wraps
        want = np.asarray(want).astype(dtype.numpy_storage).astype(np.int64)
    p = mismatch(got, want, dtype, what)
    if p:
        problems.append(p)


# ---- rank-side checks -------------------------------------------------------------------------

def all_reduce_everything(p2p, algo, dtypes):
    call, problems, n = Caller(p2p, algo), [], p2p.size
    results = {}
    for dtype in dtypes:
        for op in ops_for(dtype):
            for count in SIZES:
                for inplace in (True, False):
                    ins = [values(dtype, count, r, count + 3 * int(op), op) for r in range(n)]
                    x = make(ins[p2p.rank], dtype)
                    out = x if inplace else empty(count, dtype)
                    call(OpKind.ALL_REDUCE, x, out, dtype=dtype, count=count, op=op, scale=0.5)
                    what = f"{algo} all_reduce {dtype.name} {op.name} n={count} inplace={inplace}"
                    _check(problems, out, reduce(ins, op, dtype, 0.5), dtype, what)
                    if not inplace:
                        _check(problems, x, ins[p2p.rank], dtype, what + " (input changed)")
                    results[what] = as_f64(out).tobytes()
    return problems, results


def reduce_scatter_all_gather(p2p, dtypes):
    call, problems, n, r = Caller(p2p), [], p2p.size, p2p.rank
    for dtype, count in itertools.product(dtypes, SIZES):
        for op in ops_for(dtype):
            ins = [values(dtype, count * n, q, count + int(op), op) for q in range(n)]
            out = empty(count, dtype)
            call(OpKind.REDUCE_SCATTER, make(ins[r], dtype), out, dtype=dtype, count=count, op=op, scale=2.0)
            want = reduce(ins, op, dtype, 2.0)[r * count:(r + 1) * count]
            _check(problems, out, want, dtype, f"reduce_scatter {dtype.name} {op.name} n={count}")
        ins = [values(dtype, count, q, count) for q in range(n)]
        out = empty(count * n, dtype)
        call(OpKind.ALL_GATHER, make(ins[r], dtype), out, dtype=dtype, count=count)
        _check(problems, out, np.concatenate(ins), dtype, f"all_gather {dtype.name} n={count}")
        out = make(np.concatenate([ins[q] if q == r else np.zeros(count) for q in range(n)]), dtype)
        call(OpKind.ALL_GATHER, out[r * count:(r + 1) * count], out, dtype=dtype, count=count)
        _check(problems, out, np.concatenate(ins), dtype, f"all_gather in place {dtype.name} n={count}")
    return problems


def rooted(p2p, dtypes):
    call, problems, n, r = Caller(p2p), [], p2p.size, p2p.rank
    for dtype, count, root in itertools.product(dtypes, SIZES, range(n)):
        ins = [values(dtype, count, q, count + root) for q in range(n)]
        x = make(ins[r], dtype)
        call(OpKind.BROADCAST, x, x, dtype=dtype, count=count, root=root)
        _check(problems, x, ins[root], dtype, f"broadcast {dtype.name} n={count} root={root}")
        for op in ops_for(dtype):
            ins = [values(dtype, count, q, count + root + int(op), op) for q in range(n)]
            x = make(ins[r], dtype)
            for inplace in (False, True):
                out = (x if inplace else empty(count, dtype)) if r == root else None
                call(OpKind.REDUCE, x, out, dtype=dtype, count=count, op=op, scale=0.25, root=root)
                what = f"reduce {dtype.name} {op.name} n={count} root={root} inplace={inplace}"
                if r == root:
                    _check(problems, out, reduce(ins, op, dtype, 0.25), dtype, what)
                else:
                    _check(problems, x, ins[r], dtype, what + " (input changed)")
                x = make(ins[r], dtype)
        out = empty(count * n, dtype) if r == root else None
        call(OpKind.GATHER, make(ins[r], dtype), out, dtype=dtype, count=count, root=root)
        if r == root:
            _check(problems, out, np.concatenate(ins), dtype, f"gather {dtype.name} n={count} root={root}")
        big = [values(dtype, count * n, q, root) for q in range(n)]
        out = empty(count, dtype)
        call(OpKind.SCATTER, make(big[root], dtype) if r == root else None, out, dtype=dtype,
             count=count, root=root)
        _check(problems, out, big[root][r * count:(r + 1) * count], dtype, f"scatter {dtype.name} n={count}")
    return problems


def all_to_all(p2p, seeds):
    call, problems, n, r = Caller(p2p), [], p2p.size, p2p.rank
    for seed in seeds:
        splits = np.random.default_rng(seed).integers(0, 6, (n, n))  # splits[i][j]: i -> j
        ins = [values(DType.INT32, int(splits[q].sum()), q, seed) for q in range(n)]
        out = empty(int(splits[:, r].sum()), DType.INT32)
        call(OpKind.ALL_TO_ALL, make(ins[r], DType.INT32), out, dtype=DType.INT32,
             send_counts=tuple(int(c) for c in splits[r]), recv_counts=tuple(int(c) for c in splits[:, r]))
        want = np.concatenate([ins[q][splits[q, :r].sum():splits[q, :r + 1].sum()] for q in range(n)])
        _check(problems, out, want, DType.INT32, f"all_to_all seed={seed} splits={splits.tolist()}")
    return problems


def barriers(p2p, log):
    call = Caller(p2p)
    for i in range(3):
        log.append((i, "enter", p2p.rank))
        call(OpKind.BARRIER)
        log.append((i, "leave", p2p.rank))
    return []


# ---- tests --------------------------------------------------------------------------------------

def _no_problems(results):
    flat = [p for rank in results for p in (rank[0] if isinstance(rank, tuple) else rank)]
    assert not flat, "\n".join(flat[:20])


@pytest.mark.parametrize("algo", ["ring", "rd", "tree"])
@pytest.mark.parametrize("n", RANKS)
def test_all_reduce_every_dtype_and_op(algo, n):
    # The ring (the most arithmetic) sees every dtype; the others every op on a representative set.
    dtypes = ALL_DTYPES if algo == "ring" else FLOATS + [DType.INT8, DType.BOOL]
    results = run_threads(n, all_reduce_everything, algo, dtypes)
    _no_problems(results)
    for what in results[0][1]:  # every rank ends with bitwise the same result
        assert len({res[what] for _, res in results}) == 1, what


@pytest.mark.parametrize("n", RANKS)
def test_reduce_scatter_and_all_gather(n):
    _no_problems(run_threads(n, reduce_scatter_all_gather, ALL_DTYPES if n in (1, 4, 7) else FLOATS))


@pytest.mark.parametrize("n", RANKS)
def test_broadcast_reduce_gather_scatter(n):
    _no_problems(run_threads(n, rooted, dtypes(DType.FLOAT32, DType.BFLOAT16, DType.INT8) if n <= 5 else dtypes(DType.BFLOAT16)))


@pytest.mark.parametrize("n", RANKS)
def test_all_to_all_uneven(n):
    _no_problems(run_threads(n, all_to_all, range(4)))


@pytest.mark.parametrize("n", RANKS)
def test_barrier_releases_nobody_early(n):
    log = []
    run_threads(n, barriers, log)
    for i in range(3):  # in round i, every enter precedes every leave
        events = [e for e in log if e[0] == i]
        last_enter = max(k for k, e in enumerate(events) if e[1] == "enter")
        first_leave = min(k for k, e in enumerate(events) if e[1] == "leave")
        assert last_enter < first_leave


def test_collective_messages_never_match_user_tags():
    assert all(collective_tag(seq) >= 2**31 for seq in (0, 1, 2**31 - 1, 2**31, 2**40))
    assert collective_tag(5) != collective_tag(6)


def _mismatched(p2p):
    call = Caller(p2p, "rd", chunk_bytes=1 << 20)
    count = 4 if p2p.rank == 0 else 5     # ranks disagree about the size
    x = np.zeros(count, np.float32)
    call(OpKind.ALL_REDUCE, x, x, dtype=DType.FLOAT32, count=count)


def test_size_mismatch_is_an_error_not_corruption():
    with pytest.raises(Mismatch):
        run_threads(2, _mismatched)


def _lonely(p2p):
    if p2p.rank == 0:
        x = np.zeros(3, np.float32)
        desc = OpDesc(OpKind.ALL_REDUCE, as_buffer(x, op="t", writable=True),
                      as_buffer(x, op="t", writable=True), DType.FLOAT32, 3)
        run(desc, p2p, seq=1, timeout=0.3, chunk_bytes=1 << 20)


def test_wait_is_bounded_by_the_timeout():
    with pytest.raises(CommTimeout):
        run_threads(2, _lonely)


# ---- kernels and arithmetic ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_kernels_every_op(dtype):
    for op in ops_for(dtype):
        ins = [values(dtype, 257, r, int(op), op) for r in range(5)]
        keep = [make(v, dtype) for v in ins]   # the views below do not keep their arrays alive
        arrays = [as_buffer(k, op="t", writable=True).numpy() for k in keep]
        acc = np.empty_like(arrays[0])
        kernels.contribute(op, dtype, 0.5, acc, arrays[0])
        for a in arrays[1:]:
            mine = np.empty_like(a)
            kernels.contribute(op, dtype, 0.5, mine, a)
            kernels.combine(op, dtype, acc, mine)
        kernels.finalize(op, dtype, 5, acc)
        got = kernels.bf16_to_f32(acc) if dtype is DType.BFLOAT16 else acc
        assert mismatch(got, reduce(ins, op, dtype, 0.5), dtype, f"{dtype.name} {op.name}") is None


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan():
    torch = pytest.importorskip("torch", reason="torch is the reference for bfloat16 rounding")
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5e-3, 3e38, np.inf, -np.inf, np.nan, 0.0, -0.0],
                 np.float32)
    x = np.concatenate([x, np.random.default_rng(0).standard_normal(1000).astype(np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = kernels.f32_to_bf16(x)
    nan = np.isnan(x)
    assert (got[~nan] == want[~nan]).all()
    assert np.isnan(kernels.bf16_to_f32(got[nan])).all()


def test_half_precision_rounds_once_per_step():
    a, b = np.array([2048], np.float16), np.array([1], np.float16)
    kernels.combine(ReduceOp.SUM, DType.FLOAT16, a, b)   # 2049 is not a float16: ties to even
    assert a[0] == 2048


@pytest.mark.parametrize("n", range(1, 34))
def test_tree_and_doubling_arithmetic(n):
    for root in {0, n // 2, n - 1}:
        parents = {r: binomial_parent(r, n, root) for r in range(n)}
        assert [r for r, p in parents.items() if p is None] == [root]
        for r in range(n):
            for c in binomial_children(r, n, root):
                assert parents[c] == r
        assert sum(len(binomial_children(r, n, root)) for r in range(n)) == n - 1
    active = {}
    for r in range(n):
        v, fold = rd_fold(r, n)
        if fold is not None:
            assert rd_fold(fold, n)[1] == r
        if v is not None:
            active[v] = r
            assert rd_real_rank(v, n) == r
    for v, r in active.items():
        for step, peer in enumerate(rd_partners(v, n)):
            assert rd_partners(rd_fold(peer, n)[0], n)[step] == r
    for count in (0, 1, n - 1, n, 5 * n + 3):
        bounds = [segment_bounds(count, n, i) for i in range(n)]
        assert bounds[0][0] == 0 and bounds[-1][1] == count
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


# ---- properties ----------------------------------------------------------------------------------

def one_case(p2p, kind, dtype, op, count, root, algo, chunk_bytes):
    call, n, r = Caller(p2p, algo, chunk_bytes), p2p.size, p2p.rank
    ins = [values(dtype, count, q, count ^ int(op), op) for q in range(n)]
    x = make(ins[r], dtype)
    if kind == "all_reduce":
        call(OpKind.ALL_REDUCE, x, x, dtype=dtype, count=count, op=op, scale=0.5)
        want = reduce(ins, op, dtype, 0.5)
    elif kind == "reduce":
        call(OpKind.REDUCE, x, x if r == root else None, dtype=dtype, count=count, op=op, scale=0.5, root=root)
        want = reduce(ins, op, dtype, 0.5) if r == root else ins[r]
    else:
        call(OpKind.BROADCAST, x, x, dtype=dtype, count=count, root=root)
        want = ins[root]
    problems = []
    _check(problems, x, want, dtype, f"{kind} {algo} {dtype.name} {op.name} count={count} root={root}")
    return problems


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(1, 9), kind=st.sampled_from(["all_reduce", "reduce", "broadcast"]),
       dtype=st.sampled_from(ALL_DTYPES), count=st.integers(0, 300),
       algo=st.sampled_from([None, "ring", "rd", "tree"]), chunk_bytes=st.sampled_from([1, 24, 1 << 20]),
       data=st.data())
def test_property_against_numpy(n, kind, dtype, count, algo, chunk_bytes, data):
    op = data.draw(st.sampled_from(ops_for(dtype)))
    root = data.draw(st.integers(0, n - 1))
    _no_problems(run_threads(n, one_case, kind, dtype, op, count, root, algo, chunk_bytes))
