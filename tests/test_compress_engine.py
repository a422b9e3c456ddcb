"""The compressed all_reduce, reduce_scatter, all_gather and v forms inside the native engine
(native/src/algorithms/twolevel_compress.cc): odd sizes and fp8 blocks cut anywhere, every rank
the same bits, docs/compress.md's error bound, NaN and Inf as on the exact path, real
asynchronous Work, the engine's own validation, and a rank on the exact path beside compressed
ones failing instead of hanging. Quick: one host with COMM_COMPRESS=force (the flat form);
slow: 2 simulated hosts x 2 ranks (the two-level form)."""
from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks
from test_compress import FORCE, block_max, bound

pytest.importorskip("comm._native", reason="the native engine is not built")

# 0 and 1 element, a few under and over the 16-float unit and the 256-element fp8 block, a
# prime count that leaves every rank a ragged share
ODD_COUNTS = (0, 1, 3, 17, 255, 257, 1000, 65_537)


def _against(exact, got, allowed, scale=1.0) -> tuple[bool, float]:
    """(NaNs and infinities of `got` where `exact` has them, the worst excess of |got - exact| x
    scale over the bound allowed() at the finite elements: below 0 is within it). Overflow and
    NaN arithmetic are expected here: the inputs hold infinities and NaNs on purpose."""
    with np.errstate(invalid="ignore", over="ignore"):
        finite = np.isfinite(exact)
        specials = (np.array_equal(np.isnan(got), np.isnan(exact))
                    and np.array_equal(got[np.isinf(exact)], exact[np.isinf(exact)]))
        over = (np.abs(got.astype(np.float64) - exact) * scale - allowed())[finite]
    return specials, float(over.max(initial=-1.0))


def odd_inputs(rank: int, n: int, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    x = (rng.standard_normal(count) * np.exp(rng.uniform(-20, 20, count))).astype(np.float32)
    if count > 3:
        x[count // 2] = np.float32(1e37) * (rank + 1)   # huge beside small ones in one block
    if count > 7 and rank == n - 1:
        x[count - 2], x[count - 1] = np.nan, -np.inf      # specials in the ragged tail
    return x


def odd_sizes_suite(world, fmt: str, counts=ODD_COUNTS, block: int = 256) -> dict:
    import comm
    n, r = world.size, world.rank
    res = {"algorithms": set()}
    for seed, count in enumerate(counts):
        x = odd_inputs(r, n, count, seed)
        every = np.empty(n * count, np.float32)
        world.all_gather(every, x)
        xs = every.reshape(n, count)
        exact, got = x.copy(), np.empty_like(x)
        world.all_reduce(exact)
        work = world.all_reduce(x, out=got, compress=fmt, async_op=True)
        work.wait()
        res["algorithms"].add(world.session.transport._engine.last_algorithm)
        same = np.empty(n * count, np.float32)
        world.all_gather(same, got)
        identical = all(np.array_equal(same[q * count:(q + 1) * count], got, equal_nan=True) for q in range(n))
        specials, over = _against(exact, got, lambda: bound(fmt, n, np.abs(xs.astype(np.float64)).sum(axis=0),
                                                            block_max(xs, block)))
        res[count] = (identical, specials, over)
    # two posted back to back, waited in reverse: each its own result
    a = np.full(4099, r + 1, np.float32)
    b = np.full(4099, 10.0 * (r + 1), np.float32)
    wa = world.all_reduce(a, compress=fmt, async_op=True)
    wb = world.all_reduce(b, comm.AVG, compress=fmt, async_op=True)
    wb.wait()
    wa.wait()
    total = n * (n + 1) / 2
    res["queued"] = (np.abs(a - total).max() <= 2 ** -7 * total, np.abs(b - 10 * total / n).max() <= 2 ** -7 * 10 * total / n)
    return res


def check_results(results, algorithm: str) -> None:
    """Each rank's results of odd_sizes_suite or shards_suite (which also says whether in place
    gave the bits of out of place): every case identical on every rank, within the bound."""
    for r, res in enumerate(results):
        assert res.pop("algorithms") == {algorithm}, f"rank {r}: ran {res}"
        assert res.pop("queued") == (True, True), f"rank {r}: two queued compressed calls went wrong"
        assert res.pop("in place", (True,))[0], f"rank {r}: in place, other bits than out of place"
        for case, (identical, specials, over) in res.items():
            assert identical, f"rank {r}, {case}: ranks hold different bits"
            assert specials, f"rank {r}, {case}: NaN / Inf not as on the exact path"
            assert over <= 0, f"rank {r}, {case}: over the bound by {over}"


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_engine_odd_sizes_identical_within_bound(fmt):
    # 3 ranks: shares that no unit divides evenly; fp8 with a block of 48 (not a power of two)
    block = 256 if fmt == "bf16" else 48
    results = run_ranks(odd_sizes_suite, 3, fmt, ODD_COUNTS, block, env={**FORCE, "COMM_COMPRESS_BLOCK": str(block)})
    check_results(results, "compressed-flat")


def shards_suite(world, fmt: str, counts=ODD_COUNTS, block: int = 256) -> dict:
    """reduce_scatter, all_gather and their v forms compressed in the engine against the exact
    path: counts are each rank's block (v forms: rank q's block count + 7q, rank n-2's empty)."""
    import comm
    n, r = world.size, world.rank
    res = {"algorithms": set()}
    u = 2.0 ** -8 if fmt == "bf16" else 2.0 ** -4
    for seed, count in enumerate(counts):
        # reduce_scatter (AVG on every other size): block r of the sum, each element quantized once
        x = odd_inputs(r, n, n * count, seed)
        every = np.empty(n * n * count, np.float32)
        world.all_gather(every, x)
        xs = every.reshape(n, n, count)[:, r, :]   # [rank, element] of block r
        op = comm.AVG if seed % 2 else comm.SUM
        exact, got = np.empty(count, np.float32), np.empty(count, np.float32)
        world.reduce_scatter(exact, x, op)
        world.reduce_scatter(got, x, op, compress=fmt, async_op=True).wait()
        res["algorithms"].add(world.session.transport._engine.last_algorithm)
        scale = n if op is comm.AVG else 1
        specials, over = _against(exact, got, lambda: bound(fmt, n, np.abs(xs.astype(np.float64)).sum(axis=0),
                                                            block_max(xs, block)), scale)
        res[f"reduce_scatter {count}"] = (True, specials, over)
        # all_gather: each shard quantized once, every rank the same bits
        y = odd_inputs(r, n, count, seed + 50)
        ys = np.empty(n * count, np.float32)
        world.all_gather(ys, y)
        ag = np.empty(n * count, np.float32)
        world.all_gather(ag, y, compress=fmt, async_op=True).wait()
        res["algorithms"].add(world.session.transport._engine.last_algorithm)
        same = np.empty(n * n * count, np.float32)
        world.all_gather(same, ag)
        identical = all(np.array_equal(same[q * n * count:(q + 1) * n * count], ag, equal_nan=True) for q in range(n))
        # one quantization: half the bound of a sum of one
        specials, over = _against(ys, ag, lambda: 0.5 * bound(fmt, 1, np.abs(ys.astype(np.float64)), np.concatenate(
            [block_max(ys[None, q * count:(q + 1) * count], block) for q in range(n)])))
        res[f"all_gather {count}"] = (identical, specials, over)
        # the v forms: blocks of different sizes, one empty (not one whose place a host's
        # symmetry would hide: rank 2 of 4 holds the cyclic placement's third block)
        counts = [0 if q == n - 2 else count + 7 * q for q in range(n)]
        starts = np.cumsum([0] + counts)
        v = odd_inputs(r, n, int(starts[-1]), seed + 70)
        vs = np.empty(n * v.size, np.float32)
        world.all_gather(vs, v)
        mine = vs.reshape(n, -1)[:, starts[r]:starts[r + 1]]
        exact, got = np.empty(counts[r], np.float32), np.empty(counts[r], np.float32)
        world.reduce_scatter_v(exact, v, counts)
        world.reduce_scatter_v(got, v, counts, compress=fmt, async_op=True).wait()
        res["algorithms"].add(world.session.transport._engine.last_algorithm)
        specials, over = _against(exact, got, lambda: bound(fmt, n, np.abs(mine.astype(np.float64)).sum(axis=0),
                                                            block_max(mine, block)))
        res[f"reduce_scatter_v {count}"] = (True, specials, over)
        w = v[:counts[r]]
        want, agv = np.empty(int(starts[-1]), np.float32), np.empty(int(starts[-1]), np.float32)
        world.all_gather_v(want, w, counts)
        world.all_gather_v(agv, w, counts, compress=fmt, async_op=True).wait()
        res["algorithms"].add(world.session.transport._engine.last_algorithm)
        same = np.empty(n * agv.size, np.float32)
        world.all_gather(same, agv)
        identical = all(np.array_equal(same[q * agv.size:(q + 1) * agv.size], agv, equal_nan=True) for q in range(n))
        specials, over = _against(want, agv, lambda: 0.5 * bound(fmt, 1, np.abs(want.astype(np.float64)), np.concatenate(
            [block_max(want[None, starts[q]:starts[q + 1]], block) for q in range(n)])))
        res[f"all_gather_v {count}"] = (identical, specials, over)
    # float64 data (converted around the engine), premultiplied
    z = np.random.default_rng(r).standard_normal(n * 1000)
    zs = np.empty(n * z.size)
    world.all_gather(zs, z)
    zout = np.empty(1000)
    world.reduce_scatter(zout, z, comm.premul_sum(0.5), compress=fmt)
    want = 0.5 * zs.reshape(n, n, 1000)[:, r, :].sum(axis=0)
    mag = 0.5 * np.abs(zs.reshape(n, n, 1000)[:, r, :]).sum(axis=0)
    res["float64 reduce_scatter"] = (True, True, float((np.abs(zout - want) - bound(fmt, n, mag, mag)).max()))
    # in place (the input is this rank's block of the output, as torch's in-place forms): the
    # same bits as out of place
    big = odd_inputs(r, n, n * 5003, 99)
    ag_ref, rs_ref = np.empty(n * 5003, np.float32), np.empty(5003, np.float32)
    world.all_gather(ag_ref, big[r * 5003:(r + 1) * 5003], compress=fmt)
    world.reduce_scatter(rs_ref, big, compress=fmt)
    ag_in = big.copy()
    world.all_gather(ag_in, ag_in[r * 5003:(r + 1) * 5003], compress=fmt)
    world.reduce_scatter(big[r * 5003:(r + 1) * 5003], big, compress=fmt)
    same = np.array_equal(ag_in, ag_ref, equal_nan=True) and np.array_equal(big[r * 5003:(r + 1) * 5003], rs_ref,
                                                                            equal_nan=True)
    res["in place"] = (same,)
    # two posted back to back, waited in reverse: each its own result
    a, a_out = np.full(n * 4099, r + 1, np.float32), np.empty(4099, np.float32)
    b, b_out = np.full(4099, 10.0 * (r + 1), np.float32), np.empty(n * 4099, np.float32)
    wa = world.reduce_scatter(a_out, a, compress=fmt, async_op=True)
    wb = world.all_gather(b_out, b, compress=fmt, async_op=True)
    wb.wait()
    wa.wait()
    total = n * (n + 1) / 2
    want_b = np.repeat(10.0 * np.arange(1, n + 1), 4099)
    res["queued"] = (bool(np.abs(a_out - total).max() <= u * total),
                     bool(np.abs(b_out - want_b).max() <= u * want_b.max()))
    return res


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_engine_reduce_scatter_all_gather_odd_sizes(fmt):
    # 3 ranks on one host (the flat form); fp8 with a block of 48, not a power of two
    block = 256 if fmt == "bf16" else 48
    results = run_ranks(shards_suite, 3, fmt, ODD_COUNTS, block, env={**FORCE, "COMM_COMPRESS_BLOCK": str(block)})
    check_results(results, "compressed-flat")


def engine_refusals(world) -> list[str]:
    """The engine's own checks, past the communicator's (a caller of comm._native)."""
    import comm
    from comm.core.buffers import as_buffer
    from comm.core.ops import OpDesc
    eng = world.session.transport._engine
    x = np.ones(64, np.float64)
    y = np.ones(64, np.float32)
    seen = []
    for kind, dtype, op, buf, wire, block in ((0, 3, 0, x, 1, 0),     # float64
                                              (0, 2, 3, y, 2, 256),   # MAX
                                              (3, 2, 0, y, 1, 0),     # broadcast
                                              (0, 2, 0, y, 2, 0),     # fp8 without a block
                                              (0, 2, 0, y, 7, 0),     # unknown wire
                                              (1, 2, 2, y, 1, 0),     # reduce_scatter with MIN
                                              (2, 3, 0, x, 2, 256)):  # all_gather of float64
        try:
            count = 64 // world.size if kind in (1, 2) else 64
            send = as_buffer(buf[:count] if kind == 2 else buf, op="test", writable=False)
            recv = as_buffer(buf[:count] if kind == 1 else buf, op="test", writable=True)
            eng.post(OpDesc(kind, send, recv, dtype, count, op, wire=wire, wire_block=block), True)
            seen.append("accepted")
        except comm.InvalidArgument as e:
            seen.append(str(e))
    world.all_reduce(y)   # still usable
    seen.append(float(y[0]))
    # one rank exact, the other compressed: an error on both, within the timeout
    z = np.ones(1 << 16, np.float32)
    try:
        if world.rank == 0:
            world.all_reduce(z)
        else:
            world.all_reduce(z, compress="bf16")
        seen.append("no error")
    except comm.CommError as e:
        seen.append(type(e).__name__ + ": " + str(e))
    return seen


def test_engine_refuses_bad_wires_and_mixed_calls_fail():
    results = run_ranks(engine_refusals, 2, env={**FORCE, "COMM_TIMEOUT": "4"})
    wants = "float32 data in an all_reduce, reduce_scatter or all_gather (or a v form)"
    for r, seen in enumerate(results):
        assert wants in seen[0] and wants in seen[2] and wants in seen[6], seen
        assert "SUM, AVG or PREMUL_SUM" in seen[1] and "SUM, AVG or PREMUL_SUM" in seen[5], seen
        assert "fp8 scale block" in seen[3] and "wire format code 7" in seen[4], seen
        assert seen[7] == 2.0
        assert seen[8] != "no error" and f"rank {r}" in seen[8], f"rank {r}: {seen[8]}"


def exact_beside_compressed(world, op: str) -> str:
    import comm
    n = world.size
    z, part = np.ones(1 << 16, np.float32), np.ones((1 << 16) // n, np.float32)
    fmt = "bf16" if world.rank == 0 else None
    try:
        if op == "all_reduce":
            world.all_reduce(z, compress=fmt)
        elif op == "reduce_scatter":
            world.reduce_scatter(part, z, compress=fmt)
        else:
            world.all_gather(z, part, compress=fmt)
        return "no error"
    except comm.CommError as e:
        return type(e).__name__ + ": " + str(e)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_engine_names_the_wire_when_ranks_disagree(op):
    """Where the exact rank's algorithm also speaks in messages (here the ring), the headers
    differ at the first one: Mismatch at once, naming the compressed side (the shared-memory
    direct paths publish in slots instead, and the two sides meet only at the timeout)."""
    results = run_ranks(exact_beside_compressed, 2, op, env={**FORCE, "COMM_ALGO": "ring", "COMM_TIMEOUT": "30"})
    for r, seen in enumerate(results):
        assert seen.startswith("Mismatch") and f"rank {r}" in seen and "compress=bf16" in seen, seen
        assert op in seen, seen


@pytest.mark.slow
@pytest.mark.parametrize("transport, placement", [("native", [0, 0, 1, 1]), ("native", [0, 1, 0, 1]),
                                                  ("ucx", [0, 0, 1, 1])], ids=["2x2", "cyclic", "ucx-2x2"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_engine_two_level_reduce_scatter_all_gather(fmt, transport, placement):
    """The two-level forms across 2 simulated hosts: block r must land on rank r whatever the
    placement (cyclic: hosts hold ranks 0, 2 and 1, 3), large sizes in pipelined segments; and
    over the engine's UCX net."""
    from bench.cluster import NetnsCluster, unavailable
    if unavailable():
        pytest.skip(unavailable())
    if transport == "ucx":
        from transports import base
        if base.unavailable_reason("ucx") is not None:
            pytest.skip(f"ucx: {base.unavailable_reason('ucx')}")
    from harness import Cluster
    with NetnsCluster(2) as hosts:
        c = Cluster(4, transport, netns=[hosts.ns[h] for h in placement], timeout=180,
                    env={"MASTER_ADDR": hosts.addr(0), "COMM_TIMEOUT": "60", "COMM_COMPRESS_MIN_BYTES": "0",
                         "COMM_COMPRESS": "on"})
        try:
            results = c.run(shards_suite, fmt, ODD_COUNTS + ((3 << 20) + 5,), timeout=180)
        finally:
            c.close()
    check_results(results, "compressed-twolevel")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_engine_two_level_odd_sizes(fmt):
    from bench.cluster import NetnsCluster, unavailable
    if unavailable():
        pytest.skip(unavailable())
    from harness import Cluster
    with NetnsCluster(2) as hosts:
        c = Cluster(4, "native", netns=[hosts.ns[h] for h in (0, 0, 1, 1)], timeout=120,
                    env={"MASTER_ADDR": hosts.addr(0), "COMM_TIMEOUT": "60", "COMM_COMPRESS_MIN_BYTES": "0",
                         "COMM_COMPRESS": "on"})
        try:
            results = c.run(odd_sizes_suite, fmt, ODD_COUNTS + ((3 << 20) + 5,), timeout=120)
        finally:
            c.close()
    check_results(results, "compressed-twolevel")
