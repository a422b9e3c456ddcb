"""v-collectives: all_gather_v and reduce_scatter_v with uneven blocks (MPI's Allgatherv and
Reduce_scatter). Rank r's block is (r+1)/(1+2+..+n) of the whole (at n = 2: one third and two
thirds). Size column = the whole: the all_gather_v output, the reduce_scatter_v input; count
column = its mean block, as for the even forms; busbw factor (n-1)/n.
"""
from __future__ import annotations

import numpy as np

from .. import data
from . import Benchmark, Case, count_wrong, register
from .collectives import _out, _per_rank


def v_counts(total: int, n: int) -> tuple[int, ...]:
    """Elements of each rank's block: proportional to rank + 1, the rounding to the last."""
    counts = [total * (r + 1) // (n * (n + 1) // 2) for r in range(n)]
    counts[-1] += total - sum(counts)
    return tuple(counts)


@register
class AllGatherV(Benchmark):
    name = "all_gather_v"

    def factor(self, n):
        return (n - 1) / n

    def counts(self, nbytes, itemsize, n):
        return _per_rank(nbytes, itemsize, n)

    def case(self, runner, p, in_place):
        counts = v_counts(p.count * p.size, p.size)
        start = sum(counts[:p.rank])
        mine = data.storage(data.block(counts[p.rank], p.rank), p.dtype)
        recv = _out(sum(counts), p)
        send = recv[start:start + counts[p.rank]] if in_place else mine.copy()
        s, r = runner.wrap(send, p.dtype), runner.wrap(recv, p.dtype)

        def fill():
            recv[:] = data.sentinel(len(recv), p.dtype)
            send[:] = mine

        def check():
            expected = np.concatenate([data.storage(data.block(c, j), p.dtype) for j, c in enumerate(counts)])
            return count_wrong(self.name, recv, expected)

        return Case(runner.bind("all_gather_v", s, r, counts, in_place), fill, check)


@register
class ReduceScatterV(Benchmark):
    name, reduces = "reduce_scatter_v", True
    modes = ("out-of-place",)

    def factor(self, n):
        return (n - 1) / n

    def counts(self, nbytes, itemsize, n):
        return _per_rank(nbytes, itemsize, n)

    def case(self, runner, p, in_place):
        counts = v_counts(p.count * p.size, p.size)
        total, start = sum(counts), sum(counts[:p.rank])
        inputs = lambda: data.stored_input(total, p.dtype, p.op, p.rank, p.size)
        send, recv = inputs().copy(), _out(counts[p.rank], p)
        s, r = runner.wrap(send, p.dtype), runner.wrap(recv, p.dtype)
        op, scale = p.op, p.scale

        def fill():
            send[:] = inputs()
            recv[:] = data.sentinel(len(recv), p.dtype)

        def check():
            mine = slice(start, start + counts[p.rank])
            return count_wrong(self.name, recv, data.reduce_expected(total, p.dtype, p.op, p.size)[mine])

        return Case(runner.bind("reduce_scatter_v", s, r, counts, op, scale), fill, check)
