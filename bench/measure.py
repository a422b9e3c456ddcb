"""Timing one row of one transport: warm up, time n iterations after a barrier, check.

Iteration counts adapt to size: the first warmup iterations (up to 3) are timed, the ranks
agree on the slowest rank's fastest one, and the remaining warmups and the timed iterations are
cut so that each (size, mode) takes about --time-budget seconds (never fewer than one timed
iteration).
Small sizes therefore run the full -n, large ones fewer: a whole sweep stays short.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from comm.core.types import DType, ReduceOp

from .benchmarks import Benchmark, Params
from .launch import Control, StepFailed
from .runners import Runner


@dataclass
class Options:
    sizes: list[int]
    iters: int = 20
    warmup: int = 5
    check: int = 1
    average: int = 1            # 0 rank 0, 1 mean, 2 min, 3 max over ranks
    root: int = 0
    budget: float = 0.25        # seconds of timed iterations per (size, mode); 0: no cap
    timeout: float | None = None


AVERAGES = ("rank0", "avg", "min", "max")


@dataclass
class Mode:
    """One out-of-place or in-place measurement of one row (rank 0's aggregate)."""

    time_us: float
    algbw: float
    busbw: float
    wrong: int | None           # None: not checked
    iters: int


@dataclass
class Row:
    transport: str
    bench: str
    dtype: DType | None
    op: ReduceOp | None
    root: int
    size: int
    count: int
    modes: dict = field(default_factory=dict)     # "out-of-place" / "in-place" -> Mode | None
    run: int = 0                                   # which of --runs (0-based)


def aggregate(times: list[float], average: int) -> float:
    if average == 0:
        return times[0]
    if average == 2:
        return min(times)
    if average == 3:
        return max(times)
    return sum(times) / len(times)


def bandwidth(size: int, time_us: float, factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second), as nccl-tests prints them."""
    if time_us <= 0:
        return 0.0, 0.0
    algbw = size / 1e3 / time_us
    return algbw, algbw * factor


def _timed(run) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def time_case(run, runner: Runner, ctl: Control, opts: Options) -> tuple[float, int]:
    """(seconds per iteration on this rank, iterations timed). Collective: same counts everywhere."""
    iters, warmup = opts.iters, opts.warmup
    if warmup > 0:
        # The first call pays one-off costs (lazy set-up, ranks arriving apart, a rank that the
        # scheduler left waiting), which once cut a microsecond operation to a handful of noisy
        # iterations, and on a loaded machine to one: where they fit a quarter of the budget,
        # two more calls are timed, else one, and the fastest sizes the run. Every rank
        # decides alike (from the gathered first time): the calls are collective.
        times = [_timed(run)]
        first = max(ctl.gather(times[0]))
        more = 0 if opts.budget <= 0 else 2 if first * 3 < opts.budget / 4 else 1
        times += [_timed(run) for _ in range(min(warmup - 1, more))]
        each = max(ctl.gather(min(times))) if len(times) > 1 else first
        if opts.budget > 0 and each > 0:
            warmup = min(warmup, len(times) + int(opts.budget / 4 / each))
            iters = max(1, min(iters, int(opts.budget / each)))
        for _ in range(warmup - len(times)):
            run()
    runner.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    return (time.perf_counter() - t0) / iters, iters


def _measure_mode(bench: Benchmark, runner: Runner, ctl: Control, opts: Options, p: Params,
                  in_place: bool):
    """This rank's (seconds, iters, wrong) for one mode, or a one-line reason it was not run."""
    case = bench.case(runner, p, in_place)
    seconds, iters = time_case(case.run, runner, ctl, opts)
    wrong = None
    if opts.check:
        case.fill()
        runner.barrier()   # every rank's inputs are rewritten before anyone's check run reads them
        case.run()
        wrong = case.check()
    if case.close is not None:   # collective; after a failure the transport is measured no more
        case.close()
    return seconds, iters, wrong


def run_row(bench: Benchmark, runner: Runner, ctl: Control, opts: Options, p: Params, nbytes: int,
            transport: str) -> Row | None:
    """Measure one row (both modes). Raises StepFailed if any rank failed; None if unsupported."""
    modes = {}
    for mode in ("out-of-place", "in-place"):
        in_place = mode == "in-place"
        if mode not in bench.modes or bench.unsupported(runner, p, in_place):
            modes[mode] = None
            continue
        try:
            mine = list(_measure_mode(bench, runner, ctl, opts, p, in_place))
        except StepFailed:
            raise
        except Exception as e:   # every rank learns it at its next gather: nobody waits forever
            ctl.fail(e)
        everyone = ctl.gather(mine)
        t = aggregate([m[0] for m in everyone], opts.average) * 1e6
        wrongs = [m[2] for m in everyone]
        wrong = None if any(w is None for w in wrongs) else sum(wrongs)
        algbw, busbw = bandwidth(nbytes, t, bench.factor(p.size))
        modes[mode] = Mode(t, algbw, busbw, wrong, everyone[0][1])
    if all(m is None for m in modes.values()):
        return None
    return Row(transport, bench.name, p.dtype if bench.sweeps else None, p.op,
               p.root if bench.rooted else -1, nbytes, p.count, modes)


def warm_up(bench: Benchmark, runner: Runner, ctl: Control, opts: Options, p: Params) -> None:
    """Run the sweep's first case untimed, as long as a row is timed (about --time-budget), so
    its first sizes measure the library rather than its warm-up (lazily made threads and
    buffers, pages touched the first time, a core's clock ramping up: the first rows once took
    60x the next). Collective: every rank runs the same calls."""
    try:
        for mode in bench.modes:
            if not bench.unsupported(runner, p, mode == "in-place"):
                case = bench.case(runner, p, mode == "in-place")
                time_case(case.run, runner, ctl, opts)
                if case.close is not None:
                    case.close()
                return
    except StepFailed:
        raise
    except Exception as e:   # every rank learns it at its next gather
        ctl.fail(e)


def sweep_sizes(bench: Benchmark, opts: Options, dtype: DType, n: int) -> list[tuple[int, int]]:
    """[(count, size in bytes)] of the sweep, without repeats and without empty rows."""
    if not bench.sweeps:
        return [(0, 0)]
    out = []
    for nbytes in opts.sizes:
        count, size = bench.counts(nbytes, dtype.itemsize, n)
        if count > 0 and (not out or out[-1] != (count, size)):
            out.append((count, size))
    return out
