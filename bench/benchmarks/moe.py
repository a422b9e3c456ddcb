"""Expert-parallel MoE exchange: comm.moe dispatch / combine against the naive all_to_all.

Workload (DeepSeek-V3-like): tokens of hidden size 4096, each routed to top-8 of 64 experts
spread contiguously over the ranks; the size column is one rank's tokens (tokens * 4096 *
itemsize bytes; run with -d bfloat16 for the bf16 payload).

    moe_dispatch  tokens to the experts' ranks, grouped by local expert (routing included)
    moe_combine   expert outputs back, weighted and summed per token
    moe           the round trip: dispatch, identity experts, combine

This library (any comm runner) uses comm.moe: each token crosses the wire once per rank that
hosts one of its experts. The anchor gloo does what a naive torch implementation does
(Megatron's all-to-all token dispatcher): permute a copy of every token per expert, exchange
per-expert counts with all_to_all_single, exchange the copies with all_to_all_single, regroup
by local expert; combine reverses it. Both start from the same routing and produce the same
rows in the same order, checked exactly (#wrong): token values are small integers and every
weight is 1/8, so the weighted sums are exact even in bfloat16.

algbw = size / time. busbw = algbw * top_k * (n-1)/n (twice that for the round trip): the
rate of (token, expert) payload leaving a rank, which is what the naive exchange really moves;
for comm.moe it is an effective rate, so the busbw ratio to gloo is the speed-up.
"""
from __future__ import annotations

import numpy as np

from .. import data
from . import Benchmark, Case, count_wrong, register

HIDDEN, EXPERTS, TOP_K = 4096, 64, 8
WEIGHT = 1.0 / TOP_K                 # a power of two: products and sums stay exact
CHECK_ROWS = 2048                    # rows compared at a time (bounds the check's memory)


def routing(rank: int, tokens: int) -> np.ndarray:
    """Rank `rank`'s top-k expert ids [tokens, TOP_K]: distinct, uniformly random, seeded."""
    rng = np.random.default_rng(1234 + rank)
    return np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOP_K].astype(np.int64)


def token_value(rank: int, tokens: np.ndarray) -> np.ndarray:
    """Row (rank, t) holds token_value + (column % 4): small integers, exact in bfloat16."""
    return (rank * 7 + tokens) % 16


def _rows(bases: np.ndarray, dtype) -> np.ndarray:
    return data.storage(bases[:, None] + (np.arange(HIDDEN) % 4)[None, :], dtype)


def _storage(a, dtype) -> np.ndarray:
    """The storage bits of a numpy array or CPU tensor, as data.storage() lays them out."""
    if isinstance(a, np.ndarray):
        return a
    import torch
    return a.view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.bfloat16 else a.numpy()


def _wrong_rows(name: str, got, bases: np.ndarray, dtype) -> int:
    if len(got) != len(bases):
        return max(len(got), len(bases)) * HIDDEN
    wrong = 0
    for start in range(0, len(bases), CHECK_ROWS):
        stop = start + CHECK_ROWS
        wrong += count_wrong(name, _storage(got[start:stop], dtype), _rows(bases[start:stop], dtype))
    return wrong


def grouped_bases(rank: int, size: int, tokens: int) -> np.ndarray:
    """token_value of each row this rank's experts receive: local-expert-major, then source
    rank, then source token (the order both implementations deliver)."""
    per_rank = EXPERTS // size
    keys = []
    for src in range(size):
        idx = routing(src, tokens)
        t, j = np.nonzero((idx >= rank * per_rank) & (idx < (rank + 1) * per_rank))
        keys.append((idx[t, j] - rank * per_rank, np.full(len(t), src), t))
    expert, src, t = (np.concatenate(k) for k in zip(*keys))
    order = np.lexsort((t, src, expert))
    return ((src * 7 + t) % 16)[order]


class CommExchange:
    """This library: comm.moe on the runner's communicator."""

    def __init__(self, runner, idx: np.ndarray):
        from comm import moe
        self.moe, self.world, self.idx = moe, runner.world, idx
        self.weights = np.full(idx.shape, WEIGHT, np.float32)

    def dispatch(self, x):
        recv, handle = self.moe.dispatch(self.world, x, self.idx, self.weights, EXPERTS)
        return recv.x, handle

    def combine(self, rows, handle):
        return self.moe.combine(self.world, rows, handle)


class NaiveExchange:
    """The anchor: one copy per (token, expert) through torch.distributed.all_to_all_single."""

    def __init__(self, runner, idx: np.ndarray):
        import torch
        self.torch, self.dist, self.size = torch, runner.dist, runner.size
        self.tokens = idx.shape[0]
        flat = idx.reshape(-1)
        order = np.argsort(flat, kind="stable")             # (token, slot) pairs by expert
        self.token_of_row = torch.from_numpy(order // TOP_K)
        self.weight_of_row = torch.full((len(order), 1), WEIGHT)
        self.per_expert = torch.from_numpy(np.bincount(flat, minlength=EXPERTS))

    def dispatch(self, x):
        torch, n = self.torch, self.size
        per_rank = EXPERTS // n
        theirs = torch.empty_like(self.per_expert)          # [source][local expert]
        self.dist.all_to_all_single(theirs, self.per_expert)
        theirs = theirs.numpy().reshape(n, per_rank)
        send_splits = self.per_expert.view(n, per_rank).sum(1).tolist()
        recv_splits = theirs.sum(1).tolist()
        recv = x.new_empty((sum(recv_splits), x.shape[1]))
        self.dist.all_to_all_single(recv, x.index_select(0, self.token_of_row), recv_splits, send_splits)
        # Blocks arrive source-major; the experts want them expert-major.
        starts = np.cumsum(theirs.reshape(-1)) - theirs.reshape(-1)
        by_expert = theirs.T.reshape(-1)
        perm = np.repeat(starts.reshape(n, per_rank).T.reshape(-1) - np.cumsum(by_expert) + by_expert,
                         by_expert) + np.arange(by_expert.sum())
        perm = torch.from_numpy(perm)
        return recv.index_select(0, perm), (perm, send_splits, recv_splits)

    def combine(self, rows, state):
        torch = self.torch
        perm, send_splits, recv_splits = state
        back = torch.empty_like(rows)
        back[perm] = rows
        ret = rows.new_empty((len(self.token_of_row), rows.shape[1]))
        self.dist.all_to_all_single(ret, back, send_splits, recv_splits)
        y = torch.zeros((self.tokens, rows.shape[1]), dtype=torch.float32)
        y.index_add_(0, self.token_of_row, ret.float() * self.weight_of_row)
        return y.to(rows.dtype)


class _Moe(Benchmark):
    modes = ("out-of-place",)
    legs = 1

    def factor(self, n):
        return self.legs * TOP_K * (n - 1) / n

    def counts(self, nbytes, itemsize, n):
        tokens = nbytes // (itemsize * HIDDEN)
        return tokens * HIDDEN, tokens * HIDDEN * itemsize

    def unsupported(self, runner, p, in_place):
        if not p.dtype.is_floating:
            return "MoE payloads are floating point"
        if EXPERTS % p.size:
            return f"{EXPERTS} experts do not divide over {p.size} ranks"
        if runner.kind == "anchor" and runner.name != "gloo":
            return "the MoE anchor is gloo"
        return runner.supports("all_to_all", p.dtype, None, in_place)

    def case(self, runner, p, in_place):
        tokens = p.count // HIDDEN
        idx = routing(p.rank, tokens)
        x_bases = token_value(p.rank, np.arange(tokens))
        x = runner.wrap(_rows(x_bases, p.dtype), p.dtype)
        exchange = CommExchange(runner, idx) if runner.kind == "comm" else NaiveExchange(runner, idx)
        return self.make_case(exchange, x, x_bases, p)


@register
class MoeDispatch(_Moe):
    name = "moe_dispatch"

    def make_case(self, ex, x, x_bases, p):
        out = {}
        run = lambda: out.update(rows=ex.dispatch(x)[0])
        check = lambda: _wrong_rows(self.name, out["rows"], grouped_bases(p.rank, p.size, len(x_bases)), p.dtype)
        return Case(run, lambda: out.clear(), check)


@register
class MoeCombine(_Moe):
    name = "moe_combine"

    def make_case(self, ex, x, x_bases, p):
        rows, state = ex.dispatch(x)          # identity experts: their output is their input
        out = {}
        run = lambda: out.update(y=ex.combine(rows, state))
        return Case(run, lambda: out.clear(), lambda: _wrong_rows(self.name, out["y"], x_bases, p.dtype))


@register
class Moe(_Moe):
    name = "moe"
    legs = 2

    def make_case(self, ex, x, x_bases, p):
        out = {}
        run = lambda: out.update(y=ex.combine(*ex.dispatch(x)))
        return Case(run, lambda: out.clear(), lambda: _wrong_rows(self.name, out["y"], x_bases, p.dtype))
