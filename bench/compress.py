"""`python -m bench.compress`: compressed collectives against the exact path, across simulated hosts.

    python -m bench.compress --hosts 2 --np 2 --link-rate 2gbit -b 16M -e 64M
    python -m bench.compress --hosts 4 --np 1 --link-rate 2gbit --ops rs_ag --formats bf16

For each size, each operation (all_reduce; rs_ag: a reduce_scatter then an all_gather of the
result, the shape of an FSDP2 step) and each format (exact, then --formats), the median time of
--runs repetitions (interleaved: exact, bf16, fp8, exact, ...), the effective busbw (the
caller's uncompressed bytes over the time, with nccl-tests' all_reduce factor 2(n-1)/n for both
operations), the link bound of those bytes, the speed-up over the exact path, the path
comm.compress chose, and the measured error: max over elements of |result - exact| /
sum over ranks of |x|, the quantity docs/compress.md's bound is stated in. Random normal
float32 inputs. Rank 0 prints; --json FILE writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from . import cluster
from .cli import parse_size
from .launch import _child_env, _run_ranks

FACTOR = 2.0   # busbw = FACTOR (n-1)/n x bytes / time, for both operations


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.compress", description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts (network namespaces; root only)")
    p.add_argument("--np", type=int, default=2, help="ranks per host")
    p.add_argument("--link-rate", default=None, help="each host's link, each way (e.g. 2gbit); none: unlimited veth")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("--ops", default="all_reduce,rs_ag")
    p.add_argument("--formats", default="bf16,fp8")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("-n", "--iters", type=int, default=3, help="timed calls per repetition")
    p.add_argument("--json", default=None)
    p.add_argument("--kernels", action="store_true",
                   help="instead: each wire-format kernel's rate on this CPU (GB/s of float32), one process")
    return p.parse_args(argv)


def kernel_rates(count: int = 1 << 24, repeat: int = 5) -> int:
    """GB/s of float32 through each kernel (best of `repeat`), on one core of this machine."""
    from comm import _native
    x = np.random.default_rng(0).standard_normal(count).astype(np.float32)
    acc = np.empty_like(x)
    half, codes = np.empty(count, np.uint16), np.empty(count, np.uint8)
    scales = np.empty(count // 256 + 1, np.float32)
    p = lambda a: a.ctypes.data   # noqa: E731
    kernels = {
        "bf16 encode": lambda: _native.compress_to_bf16(p(x), p(half), count),
        "bf16 decode-add": lambda: _native.compress_bf16_add(p(acc), p(half), count, True),
        "fp8 encode": lambda: _native.compress_to_fp8(p(x), p(codes), p(scales), count, 256),
        "fp8 decode-add": lambda: _native.compress_fp8_add(p(acc), p(codes), p(scales), count, 256, True),
    }
    print(f"# wire-format kernels ({_native.kernel_isa()}), {count * 4 >> 20} MiB of float32, best of {repeat}")
    for name, run in kernels.items():
        run()
        best = min(_timed(run) for _ in range(repeat))
        print(f"{name:>16} {count * 4 / best / 1e9:7.2f} GB/s")
    return 0


def _timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.kernels:
        return kernel_rates()
    if "RANK" in os.environ:
        return rank_main(args)
    why = cluster.unavailable()
    if why:
        print(f"bench.compress: {why}", file=sys.stderr)
        return 2
    child = [sys.executable, "-m", "bench.compress"] + argv
    with cluster.NetnsCluster(args.hosts, args.link_rate) as c:
        return _run_ranks(lambda: c.launch(child, args.np, _child_env()))


def _ops(world, op: str, fmt, x, out, part):
    if op == "all_reduce":
        return lambda: world.all_reduce(x, out=out, compress=fmt)
    return lambda: (world.reduce_scatter(part, x, compress=fmt), world.all_gather(out, part, compress=fmt))


def rank_main(args) -> int:
    import comm
    from comm import compress

    world = comm.init()
    n, r = world.size, world.rank
    formats = [None] + [f for f in args.formats.split(",") if f]
    rows = []
    size = args.minbytes
    while size <= args.maxbytes:
        count = size // 4 // n * n
        rng = np.random.default_rng(r)
        x = rng.standard_normal(count).astype(np.float32)
        out = np.empty_like(x)
        part = np.empty(count // n, np.float32)
        magnitude = np.abs(x)
        world.all_reduce(magnitude)   # sum over ranks of |x|: the scale of the error bound
        for op in args.ops.split(","):
            results, times = {}, {f: [] for f in formats}
            for f in formats:   # warm-up: sub-communicators, and COMM_COMPRESS=auto's measurement
                for _ in range(compress.PROBE_CALLS + 1 if f else 1):   # the last: the path chosen
                    _ops(world, op, f, x, out, part)()
                results[f] = out.copy()
            for _ in range(args.runs):
                for f in formats:
                    run = _ops(world, op, f, x, out, part)
                    world.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        run()
                    world.barrier()
                    times[f].append((time.perf_counter() - t0) / args.iters)
            exact_t = statistics.median(times[None])
            labels = ("all_reduce",) if op == "all_reduce" else ("reduce_scatter", "all_gather")
            for f in formats:
                t = statistics.median(times[f])
                err = float(np.max(np.abs(results[f] - results[None]) / np.maximum(magnitude, 1e-30)))
                err = max(world_max(world, err), 0.0)
                bound = cluster.link_bound("all_reduce", args.hosts, args.np, args.link_rate) if args.link_rate else None
                rows.append({"bytes": count * 4, "op": op, "format": f or "exact", "time_us": t * 1e6,
                             "busbw_gbps": FACTOR * (n - 1) / n * count * 4 / t / 1e9,
                             "link_bound_gbps": bound, "speedup": exact_t / t,
                             "path": "exact" if f is None else " + ".join(
                                 compress.path(world, f, count * 4, label=lb)   # both move count * 4 bytes
                                 for lb in labels),
                             "max_rel_error": err})
        size *= args.stepfactor
    if r == 0:
        print(f"# bench.compress: {args.hosts} hosts x {args.np} ranks, links {args.link_rate or 'unlimited'}, "
              f"median of {args.runs} runs x {args.iters} calls")
        print(f"{'bytes':>10} {'op':>10} {'format':>6} {'time(us)':>11} {'busbw':>7} {'bound':>7} {'x exact':>8} "
              f"{'max rel err':>11}  path")
        for row in rows:
            bound = f"{row['link_bound_gbps']:7.3f}" if row["link_bound_gbps"] else f"{'-':>7}"
            print(f"{row['bytes']:>10} {row['op']:>10} {row['format']:>6} {row['time_us']:>11.0f} "
                  f"{row['busbw_gbps']:>7.3f} {bound} {row['speedup']:>8.2f} {row['max_rel_error']:>11.2e}  {row['path']}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
            print(f"# wrote {args.json}")
    world.close()
    return 0


def world_max(world, value: float) -> float:
    v = np.array([value], np.float64)
    world.all_reduce(v, op=__import__("comm").MAX)
    return float(v[0])


if __name__ == "__main__":
    sys.exit(main())
