"""Every native algorithm, forced with COMM_ALGO, against numpy, over shared memory and TCP.

A small COMM_CHUNK_BYTES makes the pipelined algorithms cross many chunk boundaries at
test-sized inputs. The engine reports which algorithm ran, so a forced algorithm that
silently fell back would fail here.
"""
import numpy as np
import pytest

from comm.core.types import DType, ReduceOp
from harness import assert_no_problems, slow
from reference import empty, make, mismatch, reduce, reduce_scatter_v, v_counts, values

# Which kinds each algorithm implements (shm-only ones fall back over TCP).
IMPLEMENTS = {
    "ring": {"all_reduce", "reduce_scatter", "all_gather", "all_gather_v", "reduce_scatter_v"},
    "tree": {"all_reduce", "broadcast", "reduce"},
    "rd": {"all_reduce"},
    "direct": {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather", "barrier",
               "all_gather_v", "reduce_scatter_v", "all_to_all"},
    "tuned": {"all_reduce"},   # runs ring or cma, and reports which
    "cma": {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_gather_v", "reduce_scatter_v",
            "all_to_all"},
    "linear": {"gather", "scatter"},
    "pairwise": {"all_to_all"},
    "dissemination": {"barrier"},
}
SHM_ONLY = {"direct", "cma", "tuned"}
RUNS = {"tuned": {"ring", "cma"}}   # what a forced algorithm reports having run
CASES = [(DType.FLOAT32, ReduceOp.SUM), (DType.INT32, ReduceOp.MAX), (DType.FLOAT16, ReduceOp.AVG),
         (DType.INT64, ReduceOp.BXOR), (DType.FLOAT64, ReduceOp.PREMUL_SUM), (DType.BOOL, ReduceOp.PRODUCT)]
COUNTS = [0, 1, 7, 1001, 20_000]


def check_every_collective(world, algo, channels):
    """Rank side: every collective x CASES x COUNTS; returns problems and algorithms seen."""
    n, r = world.size, world.rank
    problems, used = [], {}

    def note(kind, what, got, want, dtype):
        p = mismatch(got, want, dtype, f"{kind} {what}")
        if p:
            problems.append(f"rank {r} algo={algo}: {p}")
        used.setdefault(kind, set()).add(world.session.transport.last_algorithm)

    for dtype, op in CASES:
        for count in COUNTS:
            what = f"{dtype.name} {op.name} count={count}"
            scale = 0.5 if op is ReduceOp.PREMUL_SUM else None
            ins = [values(dtype, count, q, count + 7, op) for q in range(n)]
            x = make(ins[r], dtype)
            world.all_reduce(x, op=op, scale=scale)
            note("all_reduce", what, x, reduce(ins, op, dtype, 0.5), dtype)

            big = [values(dtype, count * n, q, count + 8, op) for q in range(n)]
            out = empty(count, dtype)
            world.reduce_scatter(out, make(big[r], dtype), op=op, scale=scale)
            note("reduce_scatter", what, out, reduce(big, op, dtype, 0.5)[r * count:(r + 1) * count], dtype)

            counts = v_counts(n, count, count)  # uneven, zeros included
            vin = [values(dtype, sum(counts), q, count + 9, op) for q in range(n)]
            out = empty(counts[r], dtype)
            world.reduce_scatter_v(out, make(vin[r], dtype), counts, op=op, scale=scale)
            note("reduce_scatter_v", f"{what} {counts}", out, reduce_scatter_v(vin, counts, r, op, dtype, 0.5), dtype)
            out = empty(sum(counts), dtype)
            world.all_gather_v(out, make(vin[r][:counts[r]], dtype), counts)
            note("all_gather_v", f"{what} {counts}", out, np.concatenate([vin[q][:counts[q]] for q in range(n)]), dtype)

            root = n - 1
            out = empty(count, dtype) if r == root else None
            world.reduce(make(ins[r], dtype), root=root, op=op, out=out, scale=scale)
            if r == root:
                note("reduce", what, out, reduce(ins, op, dtype, 0.5), dtype)
            else:
                used.setdefault("reduce", set()).add(world.session.transport.last_algorithm)

        ins = [values(dtype, 1001, q, 99) for q in range(n)]
        out = empty(1001 * n, dtype)
        world.all_gather(out, make(ins[r], dtype))
        note("all_gather", dtype.name, out, np.concatenate(ins), dtype)

        x = make(ins[r], dtype)
        world.broadcast(x, root=1 % n)
        note("broadcast", dtype.name, x, ins[1 % n], dtype)

        out = empty(1001 * n, dtype) if r == 0 else None
        world.gather(out, make(ins[r], dtype), root=0)
        if r == 0:
            note("gather", dtype.name, out, np.concatenate(ins), dtype)
        else:
            used.setdefault("gather", set()).add(world.session.transport.last_algorithm)

        full = values(dtype, 1001 * n, 0, 5)
        out = empty(1001, dtype)
        world.scatter(out, make(full, dtype) if r == n - 1 else None, root=n - 1)
        note("scatter", dtype.name, out, full[r * 1001:(r + 1) * 1001], dtype)

    # all_to_all with uneven splits: rank q sends (q + p) % 3 + 1 rows of 5 to rank p
    rows = lambda q, p: (q + p) % 3 + 1  # noqa: E731
    send = np.concatenate([np.full((rows(r, p), 5), 100 * r + p, np.int32) for p in range(n)])
    out = np.zeros((sum(rows(q, r) for q in range(n)), 5), np.int32)
    world.all_to_all(out, send, out_splits=[rows(q, r) for q in range(n)],
                     in_splits=[rows(r, p) for p in range(n)])
    want = np.concatenate([np.full((rows(q, r), 5), 100 * q + r, np.int32) for q in range(n)])
    note("all_to_all", "uneven", out, want.reshape(-1), DType.INT32)

    world.barrier()
    used.setdefault("barrier", set()).add(world.session.transport.last_algorithm)
    return problems, {k: sorted(v) for k, v in used.items()}


def _check(cluster, n, algo, channels):
    env = {"COMM_ALGO": algo, "COMM_CHUNK_BYTES": "4096", "COMM_CHANNELS": channels}
    results = cluster(n, "native", env=env).run(check_every_collective, algo, channels, timeout=300)
    assert_no_problems(rank_problems for rank_problems, _ in results)
    used = results[0][1]
    forced_here = channels == "auto" or algo not in SHM_ONLY
    for kind in IMPLEMENTS[algo]:
        if forced_here:
            assert set(used[kind]) & RUNS.get(algo, {algo}), f"{kind} ran {used[kind]}, not the forced {algo}"


# shared-memory-only algorithms have nothing to force over TCP (they fall back there)
@pytest.mark.parametrize("algo, channels", [(a, c) for a in sorted(IMPLEMENTS) for c in ("auto", "tcp")
                                            if not (c == "tcp" and a in SHM_ONLY)])
def test_forced_algorithm(cluster, algo, channels):
    _check(cluster, 3, algo, channels)


@pytest.mark.parametrize("n,algo", [(2, "ring"), (4, "rd"), (4, "direct"), (4, "cma"),
                                    *slow((5, "ring"), (5, "tree"), (5, "rd"))])
def test_other_group_sizes(cluster, n, algo):
    _check(cluster, n, algo, "auto")


@pytest.mark.parametrize("n", [2, 5])
def test_default_selection_over_tcp(cluster, n):
    _check(cluster, n, "ring", "tcp")


def tuned_runs(world, count, calls):
    """Rank side: `calls` all_reduces of one size; (what ran, whether each result was right)."""
    ran, right = [], []
    for i in range(calls):
        x = np.full(count, world.rank + i, np.float32)
        world.all_reduce(x)
        ran.append(world.session.transport.last_algorithm)
        right.append(bool((x == sum(r + i for r in range(world.size))).all()))
    return ran, right


@pytest.mark.parametrize("n", [2, 3])
def test_tuned_choice_is_the_same_on_every_rank(cluster, n):
    """Local rank 0 measures ring against cma and picks per call: every rank runs its pick
    (a rank running the other would deadlock or be wrong), and both get tried."""
    results = cluster(n, "native", env={"COMM_ALGO": "tuned"}).run(tuned_runs, (256 << 10) + 3, 40)
    for ran, right in results:
        assert ran == results[0][0] and all(right), (ran, right)
    assert set(results[0][0]) == {"ring", "cma"}, results[0][0]


def _half_inputs(rank: int, count: int) -> np.ndarray:
    """float32 values that round differently as halves: ties, tiny and huge values, inf, NaN."""
    rng = np.random.default_rng(rank)
    x = (rng.standard_normal(count) * 10.0 ** rng.integers(-6, 5, count)).astype(np.float32)
    x[:8] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0, 1e-8, 3.0e38]
    return x


def half_results(world, count):
    """Rank side: this rank's inputs and results per (dtype name, op name), as uint16 bits."""
    import torch
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG,
                   ReduceOp.PREMUL_SUM):
            x = torch.from_numpy(_half_inputs(world.rank, count)).to(dtype)
            world.all_reduce(x, op=op, scale=0.3 if op is ReduceOp.PREMUL_SUM else None)
            out[str(dtype), op.name] = x.view(torch.int16).numpy().view(np.uint16)
    return out


@pytest.mark.parametrize("count", [1001, 70_000])   # direct and rd with a tail; the ring
def test_half_reductions_are_rounded_once_per_step(cluster, count):
    """fp16/bf16 reduce in float32 and round once per step: bit for bit what torch computes
    (the vector kernels must round as the scalar ones do), NaN where torch has NaN."""
    torch = pytest.importorskip("torch", reason="torch makes the bf16 reference")
    results = cluster(2).run(half_results, count, timeout=300)
    for dtype in (torch.float16, torch.bfloat16):
        a, b = (torch.from_numpy(_half_inputs(q, count)).to(dtype).float() for q in range(2))
        as_half = lambda v: v.to(dtype)  # noqa: E731
        want = {
            "SUM": as_half(a + b), "PRODUCT": as_half(a * b),
            "MIN": as_half(torch.where(b < a, b, a)), "MAX": as_half(torch.where(a < b, b, a)),
            "AVG": as_half(as_half(a + b).float() * 0.5),
            "PREMUL_SUM": as_half(as_half(a * 0.3).float() + as_half(b * 0.3).float()),
        }
        for op, w in want.items():
            w_bits = w.view(torch.int16).numpy().view(np.uint16)
            nan = w.isnan().numpy()
            for rank, got in enumerate(results):
                bits = got[str(dtype), op]
                got_nan = torch.from_numpy(bits.view(np.int16)).view(dtype).isnan().numpy()
                assert (got_nan == nan).all(), f"rank {rank} {dtype} {op}: NaN where torch has none, or not"
                wrong = np.flatnonzero((bits != w_bits) & ~nan)
                assert wrong.size == 0, (f"rank {rank} {dtype} {op}: {wrong.size} of {count} differ, first at "
                                         f"{wrong[0]}: {bits[wrong[0]]:#06x} vs torch {w_bits[wrong[0]]:#06x}")


def all_to_all_sizes(world):
    """Uneven all_to_all whose largest input fits a slot, and past it (single-copy reads, or the
    pairwise exchange where they are not allowed); returns problems and the algorithms the
    engine named."""
    n, r = world.size, world.rank
    problems, used = [], []
    for width in (16, 1 << 16, 1 << 20):   # rows of float32: 64 B, 256 KiB, 4 MiB
        rows = lambda q, p: (q + 2 * p) % 3  # noqa: E731  (zeros included)
        send = np.concatenate([np.full((rows(r, p), width), 10 * r + p, np.float32) for p in range(n)])
        out = np.zeros((sum(rows(q, r) for q in range(n)), width), np.float32)
        world.all_to_all(out, send, [rows(q, r) for q in range(n)], [rows(r, p) for p in range(n)])
        want = np.concatenate([np.full((rows(q, r), width), 10 * q + r, np.float32) for q in range(n)])
        if not (out == want).all():
            problems.append(f"rank {r}: all_to_all rows of {width} wrong")
        used.append(world.session.transport.last_algorithm)
    return problems, used


@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_every_size(cluster, n):
    results = cluster(n, "native").run(all_to_all_sizes, timeout=300)
    assert_no_problems(p for p, _ in results)
