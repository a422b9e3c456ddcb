"""Benchmarks: what is measured, on any runner. Every module in this folder is loaded at start.

Adding a benchmark is a one-file change: put a module in bench/benchmarks/ (e.g. moe.py) with

    from bench.benchmarks import Benchmark, Case, Params, register

    @register
    class MoeDispatch(Benchmark):
        name = "moe"
        factor_name = "(n-1)/n"          # shown nowhere but docs; factor() is what counts
        reduces = False                  # True: a redop column and -o apply
        modes = ("out-of-place",)        # the table columns it fills

        def factor(self, n): return (n - 1) / n           # busbw = algbw * factor
        def counts(self, nbytes, itemsize, n): ...         # -> (count column, size column in bytes)
        def unsupported(self, runner, p, in_place):        # None, or why this runner cannot
            return None if runner.kind == "comm" else "comm only"
        def case(self, runner, p, in_place) -> Case:
            ...                                            # allocate, then
            return Case(run=..., fill=..., check=...)

`run` is the timed operation (keep it to the library call), `fill` rewrites the inputs before
the check run, `check` returns the number of wrong elements on this rank after it. A comm
runner exposes its communicator as `runner.world`. `python -m bench moe` then runs it, with
every flag, table, JSON and plot feature.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

from comm.core.types import DType, ReduceOp

from .. import data


@dataclass
class Params:
    """One row of a sweep on one rank."""

    count: int                 # the count column: elements per rank, as nccl-tests counts them
    dtype: DType
    op: ReduceOp | None        # None for benchmarks without a reduction
    root: int
    rank: int
    size: int

    @property
    def scale(self) -> float | None:
        return data.PREMUL_FACTOR if self.op is ReduceOp.PREMUL_SUM else None


@dataclass
class Case:
    run: Callable[[], None]     # one operation: the timed path
    fill: Callable[[], None]    # (re)write the inputs
    check: Callable[[], int]    # wrong elements on this rank after fill() and one run()
    close: Callable[[], None] | None = None   # collective: release what the case set up (a window)


_fault_hook: Callable[[str, np.ndarray], None] | None = None


def set_fault_hook(hook: Callable[[str, np.ndarray], None] | None) -> None:
    """Tests only: hook(benchmark name, result array) runs before each check and may corrupt
    the result, to prove that #wrong sees it. Never called on the timed path."""
    global _fault_hook
    _fault_hook = hook


def count_wrong(name: str, got: np.ndarray, expected: np.ndarray) -> int:
    """Elements of `got` that differ from `expected` (bit-exact for float16/bfloat16 storage)."""
    if _fault_hook is not None:
        _fault_hook(name, got)
    return int(np.count_nonzero(got != expected))


class Benchmark:
    name: ClassVar[str]
    reduces: ClassVar[bool] = False          # has a reduction op (-o applies, redop column)
    rooted: ClassVar[bool] = False           # has a root (-r applies, root column)
    sweeps: ClassVar[bool] = True            # False: one row, no size sweep (barrier)
    min_ranks: ClassVar[int] = 1
    modes: ClassVar[tuple[str, ...]] = ("out-of-place", "in-place")

    def factor(self, n: int) -> float:
        """busbw = algbw * factor(n), as nccl-tests defines it."""
        return 1.0

    def counts(self, nbytes: int, itemsize: int, n: int) -> tuple[int, int]:
        """Swept size in bytes -> (count column, size column in bytes), as nccl-tests computes them."""
        count = nbytes // itemsize
        return count, count * itemsize

    def unsupported(self, runner, p: Params, in_place: bool) -> str | None:
        return runner.supports(self.name, p.dtype, p.op, in_place)

    def case(self, runner, p: Params, in_place: bool) -> Case:
        raise NotImplementedError


BENCHMARKS: dict[str, Benchmark] = {}


def register(cls: type[Benchmark]) -> type[Benchmark]:
    BENCHMARKS[cls.name] = cls()
    return cls


def load_all() -> dict[str, Benchmark]:
    """Import every module of this package (each registers its benchmarks)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return BENCHMARKS
