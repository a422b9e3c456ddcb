"""One-sided benchmarks: windows' put / get, put with a signal, and a KV-cache transfer.

Every rank targets its right neighbour's window (a ring, as `sendrecv`), so the left neighbour
writes into its window meanwhile; each operation is complete at both ends when it returns
(bench/windows.py says how, per library):

    put         put `size` bytes, then flush(peer)                     busbw = algbw
    get         get `size` bytes, then flush(peer)                     busbw = algbw
    put_signal  a token goes once around the ring: each rank waits for its counter to move
                (the left neighbour's put with a signal), then puts `size` bytes with a signal
                to the right; time = the round (2 ranks: a ping-pong, twice the one-way latency)
    kv          a paged KV-cache transfer: KV_BLOCKS blocks of `-b..-e` bytes each put into
                shuffled slots of the peer's pool of 2 x KV_BLOCKS blocks, the last with a
                signal; done when this rank has seen its left neighbour's signal. The size
                column is the request (KV_BLOCKS blocks), the count column its elements

Runners: this library's transports (comm.Window), `mpi-raw` (MPI_Put / MPI_Get +
MPI_Win_flush; signals emulated: an MPI_Put of a count after a flush), and the
anchors `comm-p2p`, this library's send / recv doing the same transfers two-sided, and
`memcpy`, a copy of the same bytes into the rank's own window (put, get, kv).
`python -m bench --np 2 kv` is a preset (bench/cli.py).
"""
from __future__ import annotations

import numpy as np

from .. import data
from . import Benchmark, Case, count_wrong, register

KV_BLOCKS = 32


class _OneSided(Benchmark):
    modes = ("out-of-place",)
    min_ranks = 2

    def unsupported(self, runner, p, in_place):
        return runner.supports(self.name, p.dtype, None, in_place)

    def _ring(self, p):
        return (p.rank + 1) % p.size, (p.rank - 1) % p.size


def _window_case(bench: _OneSided, runner, p, op: str) -> Case:
    """put / get / put_signal: one block of p.count elements, each rank's window holding one."""
    peer, left = bench._ring(p)
    mine = data.storage(data.block(p.count, p.rank), p.dtype)
    sentinel = data.sentinel(p.count, p.dtype)
    h = runner.open_window((mine if op == "get" else sentinel).copy().view(np.uint8))
    mem = h.mem
    src = runner.wrap(mine.copy(), p.dtype)
    dst = data.sentinel(p.count, p.dtype).copy()
    if op == "put":
        run = runner.bind("put_flush", h, src, peer, 0)
    elif op == "get":
        run = runner.bind("get_flush", h, runner.wrap(dst, p.dtype), peer, 0)
    else:
        run = runner.bind("signal_hop", h, src, peer, 0, p.rank == 0)

    def fill():
        if op == "get":
            dst[:] = sentinel
        else:
            mem[:] = sentinel.view(np.uint8)
        runner.window_fence(h)

    local = getattr(runner, "local", False)   # memcpy: its own window, no peer

    def check():
        runner.window_fence(h)   # the left neighbour's put has landed here too
        if op == "get":
            return count_wrong(bench.name, dst, data.storage(data.block(p.count, p.rank if local else peer), p.dtype))
        got = mem.view(mine.dtype)[:p.count]
        return count_wrong(bench.name, got, data.storage(data.block(p.count, p.rank if local else left), p.dtype))

    return Case(run, fill, check, close=lambda: runner.close_window(h))


@register
class Put(_OneSided):
    name = "put"

    def case(self, runner, p, in_place):
        return _window_case(self, runner, p, "put")


@register
class Get(_OneSided):
    name = "get"

    def case(self, runner, p, in_place):
        return _window_case(self, runner, p, "get")


@register
class PutSignal(_OneSided):
    name = "put_signal"

    def case(self, runner, p, in_place):
        return _window_case(self, runner, p, "put_signal")


@register
class KV(_OneSided):
    name = "kv"

    def counts(self, nbytes, itemsize, n):
        count = nbytes // itemsize * KV_BLOCKS
        return count, count * itemsize

    def case(self, runner, p, in_place):
        peer, left = self._ring(p)
        per = p.count // KV_BLOCKS
        blocks = [data.storage(data.block(per, p.rank * KV_BLOCKS + i), p.dtype) for i in range(KV_BLOCKS)]
        block_bytes = blocks[0].nbytes
        slots = np.random.default_rng(7).permutation(2 * KV_BLOCKS)[:KV_BLOCKS]   # same on every rank
        offsets = [int(s) * block_bytes for s in slots]
        h = runner.open_window(np.zeros(2 * KV_BLOCKS * block_bytes, np.uint8))
        pool = h.mem
        srcs = [runner.wrap(b, p.dtype) for b in blocks]
        run = runner.bind("kv_put", h, srcs, peer, offsets)

        def fill():
            pool[:] = 0
            runner.window_fence(h)

        src_rank = p.rank if getattr(runner, "local", False) else left

        def check():
            runner.window_fence(h)
            got = np.concatenate([pool[o:o + block_bytes] for o in offsets]).view(blocks[0].dtype)
            want = np.concatenate([data.storage(data.block(per, src_rank * KV_BLOCKS + i), p.dtype)
                                   for i in range(KV_BLOCKS)])
            return count_wrong(self.name, got, want)

        return Case(run, fill, check, close=lambda: runner.close_window(h))
