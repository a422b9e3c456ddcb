"""The standard collectives, with nccl-tests' sizes, counts and bus-bandwidth factors.

Size column = the larger of the send and receive buffer of one rank; algbw = size / time;
busbw = algbw * factor (nccl-tests' PERFORMANCE.md): all_reduce 2(n-1)/n; reduce_scatter,
all_gather, all_to_all(_v) (n-1)/n; broadcast, reduce, sendrecv 1.
"""
from __future__ import annotations

import numpy as np

from .. import data
from . import Benchmark, Case, Params, count_wrong, register


def _out(count: int, p: Params) -> np.ndarray:
    """An output buffer holding the sentinel, so an operation that writes nothing is caught."""
    return data.sentinel(count, p.dtype).copy()


def _per_rank(nbytes: int, itemsize: int, n: int) -> tuple[int, int]:
    count = nbytes // itemsize // n
    return count, count * n * itemsize


@register
class AllReduce(Benchmark):
    name, reduces = "all_reduce", True

    def factor(self, n):
        return 2 * (n - 1) / n

    def case(self, runner, p, in_place):
        inputs = lambda: data.stored_input(p.count, p.dtype, p.op, p.rank, p.size)
        send = inputs().copy()
        recv = send if in_place else _out(p.count, p)
        s = runner.wrap(send, p.dtype)
        r = s if in_place else runner.wrap(recv, p.dtype)
        op, scale = p.op, p.scale

        def fill():
            send[:] = inputs()
            if not in_place:
                recv[:] = data.sentinel(p.count, p.dtype)

        def check():
            return count_wrong(self.name, recv, data.reduce_expected(p.count, p.dtype, p.op, p.size))

        return Case(runner.bind("all_reduce", s, r, op, scale, in_place), fill, check)


@register
class ReduceScatter(Benchmark):
    name, reduces = "reduce_scatter", True
    modes = ("out-of-place",)

    def factor(self, n):
        return (n - 1) / n

    def counts(self, nbytes, itemsize, n):
        return _per_rank(nbytes, itemsize, n)

    def case(self, runner, p, in_place):
        total = p.count * p.size
        inputs = lambda: data.stored_input(total, p.dtype, p.op, p.rank, p.size)
        send, recv = inputs().copy(), _out(p.count, p)
        s, r = runner.wrap(send, p.dtype), runner.wrap(recv, p.dtype)
        op, scale = p.op, p.scale

        def fill():
            send[:] = inputs()
            recv[:] = data.sentinel(p.count, p.dtype)

        def check():
            mine = slice(p.rank * p.count, (p.rank + 1) * p.count)
            return count_wrong(self.name, recv, data.reduce_expected(total, p.dtype, p.op, p.size)[mine])

        return Case(runner.bind("reduce_scatter", s, r, op, scale), fill, check)


@register
class AllGather(Benchmark):
    name = "all_gather"

    def factor(self, n):
        return (n - 1) / n

    def counts(self, nbytes, itemsize, n):
        return _per_rank(nbytes, itemsize, n)

    def case(self, runner, p, in_place):
        c = p.count
        mine = data.storage(data.block(c, p.rank), p.dtype)
        recv = _out(c * p.size, p)
        send = recv[p.rank * c:(p.rank + 1) * c] if in_place else mine.copy()
        s, r = runner.wrap(send, p.dtype), runner.wrap(recv, p.dtype)

        def fill():
            recv[:] = data.sentinel(c * p.size, p.dtype)
            send[:] = mine

        def check():
            expected = np.concatenate([data.storage(data.block(c, j), p.dtype) for j in range(p.size)])
            return count_wrong(self.name, recv, expected)

        return Case(runner.bind("all_gather", s, r, in_place), fill, check)


@register
class Broadcast(Benchmark):
    name, rooted = "broadcast", True
    modes = ("in-place",)   # every library here broadcasts in place

    def case(self, runner, p, in_place):
        source = data.storage(data.block(p.count, p.root + 1), p.dtype)
        buf = source.copy() if p.rank == p.root else _out(p.count, p)
        b = runner.wrap(buf, p.dtype)
        root = p.root

        def fill():
            buf[:] = source if p.rank == p.root else data.sentinel(p.count, p.dtype)

        return Case(runner.bind("broadcast", b, root), fill, lambda: count_wrong(self.name, buf, source))


@register
class Reduce(Benchmark):
    name, reduces, rooted = "reduce", True, True

    def case(self, runner, p, in_place):
        at_root = p.rank == p.root
        inputs = lambda: data.stored_input(p.count, p.dtype, p.op, p.rank, p.size)
        send = inputs().copy()
        recv = send if in_place else (_out(p.count, p) if at_root else None)
        s = runner.wrap(send, p.dtype)
        r = s if in_place else (runner.wrap(recv, p.dtype) if at_root else None)
        op, scale, root = p.op, p.scale, p.root

        def fill():
            send[:] = inputs()
            if at_root and not in_place:
                recv[:] = data.sentinel(p.count, p.dtype)

        def check():
            if not at_root:
                return 0
            return count_wrong(self.name, recv, data.reduce_expected(p.count, p.dtype, p.op, p.size))

        return Case(runner.bind("reduce", s, r, root, op, scale, in_place), fill, check)


def _all_to_all_case(bench: Benchmark, runner, p: Params, splits: np.ndarray) -> Case:
    """splits[s][d]: elements rank s sends to rank d. Block (s -> d) holds data.block(., s*n + d)."""
    n, me = p.size, p.rank
    send_counts, recv_counts = tuple(int(c) for c in splits[me]), tuple(int(c) for c in splits[:, me])
    source = np.concatenate([data.storage(data.block(c, me * n + d), p.dtype) for d, c in enumerate(send_counts)])
    send, recv = source.copy(), _out(sum(recv_counts), p)
    s, r = runner.wrap(send, p.dtype), runner.wrap(recv, p.dtype)

    def fill():
        send[:] = source
        recv[:] = data.sentinel(len(recv), p.dtype)

    def check():
        expected = np.concatenate([data.storage(data.block(c, src * n + me), p.dtype)
                                   for src, c in enumerate(recv_counts)])
        return count_wrong(bench.name, recv, expected)

    return Case(runner.bind("all_to_all", s, r, send_counts, recv_counts), fill, check)


@register
class AllToAll(Benchmark):
    name = "all_to_all"
    modes = ("out-of-place",)

    def factor(self, n):
        return (n - 1) / n

    def counts(self, nbytes, itemsize, n):
        return _per_rank(nbytes, itemsize, n)

    def case(self, runner, p, in_place):
        return _all_to_all_case(self, runner, p, np.full((p.size, p.size), p.count))


def moe_splits(total: int, n: int) -> np.ndarray:
    """Uneven all-to-all counts as an MoE router makes them: every rank sends `total` elements,
    split over destination ranks (experts) with Zipf popularity 1/(d+1) -- rank 0 the hottest,
    getting 2.2x the average at n = 8 -- and a little per-source variation (odd s+d get 25% more).
    The remainder of the rounding goes to the hottest expert. Same matrix on every rank."""
    s, d = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    weight = (1.0 / (d + 1)) * (1 + 0.25 * ((s + d) & 1))
    splits = np.floor(total * weight / weight.sum(1, keepdims=True)).astype(np.int64)
    splits[:, 0] += total - splits.sum(1)
    return splits


@register
class AllToAllV(Benchmark):
    """Size column = elements one rank sends (every rank sends the same amount, receives unevenly)."""

    name = "all_to_all_v"
    modes = ("out-of-place",)

    def factor(self, n):
        return (n - 1) / n

    def case(self, runner, p, in_place):
        return _all_to_all_case(self, runner, p, moe_splits(p.count, p.size))


@register
class SendRecv(Benchmark):
    """Pipeline p2p: every rank sends to rank+1 and receives from rank-1 (a ring), at once."""

    name, min_ranks = "sendrecv", 2
    modes = ("out-of-place",)

    def case(self, runner, p, in_place):
        dst, src = (p.rank + 1) % p.size, (p.rank - 1) % p.size
        send, recv = data.storage(data.block(p.count, p.rank), p.dtype), _out(p.count, p)
        s, r = runner.wrap(send, p.dtype), runner.wrap(recv, p.dtype)
        expected = data.storage(data.block(p.count, src), p.dtype)

        def fill():
            recv[:] = data.sentinel(p.count, p.dtype)

        return Case(runner.bind("sendrecv", s, r, dst, src), fill, lambda: count_wrong(self.name, recv, expected))


@register
class Barrier(Benchmark):
    """Latency of a barrier: one row, no data, nothing to check."""

    name, sweeps = "barrier", False
    modes = ("out-of-place",)

    def factor(self, n):
        return 0.0

    def counts(self, nbytes, itemsize, n):
        return 0, 0

    def case(self, runner, p, in_place):
        return Case(runner.bind("barrier"), lambda: None, lambda: None)
