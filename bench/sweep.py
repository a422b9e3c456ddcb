"""The sweep of one benchmark over every transport at once, interleaved.

A shared machine's speed drifts by 2x and more between minutes. Swept one transport after the
other, a slow minute lands on one transport's whole band of sizes and the comparison then
compares two machines (native once read 0.2-0.4x Open MPI at 256 KiB-4 MiB in one sweep and
1.1-5x in the next, minutes later). So every transport is set up before the sweep and kept up,
and at each size each of --runs repetitions measures every transport once, the order rotated
by one per repetition (`order`): the cells compared at one size are measured within a second or
two of each other. The repetitions are passes over all the sizes, one after the other, so the
repetitions of one size lie seconds apart: a burst of a second or two hits one of them, and
the median drops it. With the repetitions of a size back to back, two of native's three at
2 MiB once fell together (0.88x Open MPI in that clean-clone run, 1.36-1.45x in five others).
A slow phase longer than the sweep still shows (isolated sizes below 1 in some runs since).
"""
from __future__ import annotations

import statistics

from . import report
from .benchmarks import Benchmark, Params
from .launch import StepFailed
from .measure import Mode, Row, run_row, sweep_sizes, warm_up


def order(transports: list[str], runs: int) -> list[tuple[int, str]]:
    """(repetition, transport) in the order one size measures them: every transport once per
    repetition, each repetition starting one transport later, so none always runs first or
    always after the same neighbour (whose buffers it finds in the caches)."""
    n = len(transports)
    return [(run, transports[(run + k) % n]) for run in range(runs) for k in range(n)]


def sweep(bench: Benchmark, live: dict, failures: dict, dtypes: list, ops, args, opts, world, ctl,
          pr) -> list[Row]:
    """Measure `bench` on every runner in `live` (name -> runner, set up), interleaved per size.
    Returns every repetition's rows in the order they were measured (Row.run: the repetition).
    A transport that fails is recorded in `failures` (name -> message) and measured no more;
    the others go on. ops(bench, dtype) lists the reductions to run."""
    rows: list[Row] = []
    warm: set[str] = set() if bench.sweeps else set(live)   # warmed up once, before the first size
    for dtype in (dtypes if bench.sweeps else dtypes[:1]):
        for op in ops(bench, dtype):
            p = Params(0, dtype, op, args.root, world.rank, world.size)
            names = []
            for name, runner in live.items():
                why = [bench.unsupported(runner, p, m == "in-place") for m in bench.modes]
                if all(why):
                    pr.line(f"# {name} {bench.name} {report.dtype_name(dtype)} {report.op_name(op)}: "
                            f"not run: {why[0]}")
                else:
                    names.append(name)
            sizes = sweep_sizes(bench, opts, dtype, world.size)
            schedule = order(names, args.runs)
            for run in range(args.runs):   # a pass over every size per repetition
                turn = [name for r, name in schedule if r == run]
                for count, size in sizes:
                    p.count = count
                    for name in turn:
                        if name in failures:
                            continue
                        try:
                            row = _cell(bench, live[name], name, name not in warm, ctl, opts, p, size, run,
                                        args.runs, pr)
                        except StepFailed as e:
                            failures[name] = f"{bench.name} {report.dtype_name(dtype)} {size} B: {e}"
                            pr.line(f"# {name}: failed: {failures[name]}; it is measured no more")
                            continue
                        warm.add(name)
                        if row is not None:
                            row.run = run
                            rows.append(row)
    return rows


def _cell(bench, runner, name, cold, ctl, opts, p, size, run, runs, pr) -> Row | None:
    if cold:
        pr.progress(f"{name} {bench.name}: warming up")
        try:
            warm_up(bench, runner, ctl, opts, p)
        except StepFailed as e:
            raise StepFailed(f"warm-up: {e}") from None
    of = f", repetition {run + 1} of {runs}" if runs > 1 else ""
    pr.progress(f"{name} {bench.name} {report.dtype_name(p.dtype)} {report.op_name(p.op)} {size} B{of}")
    return run_row(bench, runner, ctl, opts, p, size, name)


def medians(rows: list[Row]) -> list[Row]:
    """One row per (transport, dtype, op, root, size) of one benchmark, in first-measured order:
    in each mode, the repetition of median time (the lower middle one of an even count), so
    time, algbw, busbw and iters are one real measurement; #wrong is summed over the
    repetitions (each one was checked)."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.transport, r.dtype, r.op, r.root, r.size), []).append(r)
    out = []
    for group in groups.values():
        first = group[0]
        modes = {}
        for mode in report.MODES:
            ms = [r.modes.get(mode) for r in group if r.modes.get(mode) is not None]
            if not ms:
                modes[mode] = None
                continue
            mid = statistics.median_low([m.time_us for m in ms])
            m = next(m for m in ms if m.time_us == mid)
            wrongs = [x.wrong for x in ms]
            modes[mode] = Mode(m.time_us, m.algbw, m.busbw, None if None in wrongs else sum(wrongs), m.iters)
        out.append(Row(first.transport, first.bench, first.dtype, first.op, first.root, first.size,
                       first.count, modes, 0))
    return out
