"""v-collectives beyond the conformance suite: ranks that pass different counts fail with
Mismatch naming both ranks' counts, on every rank and whichever algorithm each chose, and the
transports without v-collectives refuse them clearly."""
from __future__ import annotations

import numpy as np
import pytest

import comm
from harness import run_ranks
from transports import base

needs_native = pytest.mark.skipif(base.unavailable_reason("native") is not None,
                                  reason=f"native: {base.unavailable_reason('native')}")


def disagree(world, rows):
    """Rank 1 thinks its block has `rows` + 1 rows; everyone else says `rows`."""
    n, r = world.size, world.rank
    counts = [rows] * n
    if r == 1:
        counts[1] += 1
    try:
        world.all_gather_v(np.zeros(sum(counts), np.float32), np.ones(counts[r], np.float32), counts)
    except comm.CommError as e:
        return type(e).__name__, str(e)
    return None


# rows 10: direct on one host; 300_000: cma (the single-copy path); the ring forced (the counts'
# first check is its own round); tcp channels: the ring's neighbour exchange
@pytest.mark.parametrize("rows, env", [(10, {}), (300_000, {}), (300_000, {"COMM_ALGO": "ring"}),
                                       (10, {"COMM_CHANNELS": "tcp"})])
@needs_native
def test_counts_disagree_is_a_mismatch_naming_both(rows, env):
    results = run_ranks(disagree, 2, rows, env={"COMM_TIMEOUT": "20", **env}, expect_errors=True)
    for r, got in enumerate(results):
        assert got is not None, f"rank {r} accepted counts that differ"
        kind, text = got
        assert kind == "Mismatch", got
        other = 1 - r
        mine = f"[{rows}, {rows + 1}]" if r == 1 else f"[{rows}, {rows}]"
        theirs = f"[{rows}, {rows + 1}]" if other == 1 else f"[{rows}, {rows}]"
        assert f"rank {other} passed counts {theirs}, rank {r} passed {mine}" in text, text


def lean_and_full(world):
    """The engine's one-call path (1-D arrays, counts as a list of ints) and the full path
    (counts as numpy integers, or rows of 2) give the same results, blocking and async; the
    async form is a comm.Work that holds its buffers."""
    n, r = world.size, world.rank
    counts = [3 + 2 * q for q in range(n)]
    total = sum(counts)
    results = {}
    for form, cs, shape in (("lean", counts, ()), ("numpy ints", np.array(counts), ()), ("rows", counts, (2,))):
        mine = np.arange(counts[r] * (shape[0] if shape else 1), dtype=np.float32).reshape((counts[r],) + shape) + r
        gathered = np.zeros((total,) + shape, np.float32)
        w = world.all_gather_v(gathered, mine, cs, async_op=True)
        assert isinstance(w, comm.Work)
        w.wait()
        full = np.arange(total * (shape[0] if shape else 1), dtype=np.float32).reshape((total,) + shape)
        scattered = np.zeros((counts[r],) + shape, np.float32)
        world.reduce_scatter_v(scattered, full, cs)
        even_in = np.full(4 * n, r + 1.0, np.float32)
        even_out = np.zeros(4, np.float32)
        world.reduce_scatter(even_out, even_in, async_op=True).wait()
        ag = np.zeros(4 * n, np.float32)
        world.all_gather(ag, np.full(4, float(r), np.float32))
        results[form] = (gathered.tolist(), scattered.tolist(), even_out.tolist(), ag.tolist())
    try:
        world.reduce_scatter_v(np.zeros(1, np.float32), np.zeros(1, np.float32), [2 ** 70] * n)
        refused = None
    except comm.InvalidArgument as e:
        refused = str(e)
    return results, refused


def all_to_all_forms(world):
    """all_to_all through the engine's one-call path (plain arrays, 1-D or rows; splits as
    lists of ints, or none) and the full path (numpy splits), blocking and async; and the
    one-call form's bad splits and shapes refused by the full path's checks."""
    n, r = world.size, world.rank
    splits = [[1 + (2 * s + d) % 3 for d in range(n)] for s in range(n)]   # splits[s][d]: s sends d
    sends, expects = splits[r], [splits[s][r] for s in range(n)]

    def block(s, d, width):   # the rows rank s sends rank d
        start = sum(splits[s][:d])
        return [[100.0 * s + start + i + 0.5 * c for c in range(width)] for i in range(splits[s][d])]

    results, kinds = {}, {}
    for form, width, as_splits, async_op in (("lean", 1, list, False), ("lean async", 1, tuple, True),
                                             ("numpy splits", 1, np.array, False), ("rows", 2, list, False),
                                             ("rows async", 2, list, True)):
        rows = [row for d in range(n) for row in block(r, d, width)]
        x = np.array(rows, np.float32).reshape((-1, width) if width > 1 else (-1,))
        out = np.zeros((sum(expects),) + x.shape[1:], np.float32)
        w = world.all_to_all(out, x, as_splits(expects), as_splits(sends), async_op=async_op)
        if async_op:
            kinds[form] = "one call" if w._entry is None else "full path"   # the lean path records no line
            w.wait()
        results[form] = out.reshape(len(out), -1).tolist()
    want = [row for s in range(n) for row in block(s, r, 2)]
    even_in = np.arange(3 * n, dtype=np.int64) + 1000 * r
    for form, x in (("even lean", even_in), ("even rows", even_in.reshape(-1, 1))):
        out = np.zeros_like(x)
        world.all_to_all(out, x)
        results[form] = out.reshape(-1).tolist()
    refused = []
    x, out = np.zeros(sum(sends), np.float32), np.zeros(sum(expects), np.float32)
    bad = {"sum": (expects, sends[:-1] + [sends[-1] + 1]), "negative": (expects, [-1] + sends[1:]),
           "own block": ([e + (q == r) for q, e in enumerate(expects)], sends), "huge": (expects, [2 ** 70] * n),
           "rows differ": (expects, sends)}
    for what, (o, i) in bad.items():
        if what == "rows differ":
            x, out = np.zeros((sum(sends), 2), np.float32), np.zeros((sum(expects), 1, 2), np.float32)
        try:
            world.all_to_all(out, x, o, i)
            refused.append((what, None))
        except comm.InvalidArgument as e:
            refused.append((what, str(e)))
    return results, want, kinds, refused


@needs_native
def test_all_to_all_lean_path_matches_the_full_path():
    for r, (results, want, kinds, refused) in enumerate(run_ranks(all_to_all_forms, 3)):
        assert results["rows"] == results["rows async"] == np.array(want, np.float32).tolist(), r
        assert results["lean"] == [row[:1] for row in results["rows"]], r
        assert results["lean async"] == results["numpy splits"] == results["lean"], r
        assert kinds == {"lean async": "one call", "rows async": "one call"}, kinds   # the one-call path took them
        even = [1000 * s + 3 * r + i for s in range(3) for i in range(3)]
        assert results["even lean"] == results["even rows"] == even, r
        for what, text in refused:
            assert text and "all_to_all" in text and f"rank {r}" in text, (what, text)


@needs_native
def test_lean_path_matches_the_full_path():
    for r, (results, refused) in enumerate(run_ranks(lean_and_full, 2)):
        lean = results["lean"]
        assert results["numpy ints"] == lean
        g, s, e, a = lean
        assert e == [3.0] * 4 and a == [0.0] * 4 + [1.0] * 4
        assert s == [2.0 * i for i in range(3 * r, 3 * r + 3 + 2 * r)]
        assert len(g) == 3 + 5 and g[:3] == [0.0, 1.0, 2.0] and g[3:] == [1.0, 2.0, 3.0, 4.0, 5.0]
        rg = results["rows"][0]
        assert len(rg) == 8 and rg[0] == [0.0, 1.0] and rg[3] == [1.0, 2.0]
        assert refused and "reduce_scatter_v" in refused, refused
