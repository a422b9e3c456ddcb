"""Expert-parallel dispatch and combine (DeepEP's two-phase API) over any transport.

    layout = moe.dispatch_layout(topk_idx, num_experts, group)      # optional, local only
    recv, handle = moe.dispatch(group, x, topk_idx, topk_weights, num_experts, layout)
    out = run_experts(recv.per_expert())                            # rows grouped by local expert
    y = moe.combine(group, out, handle)                             # back in token order
    recv2, _ = moe.dispatch(group, x2, handle=handle)               # same routing: payload only

Experts are placed contiguously: rank r hosts experts [r * E/n, (r + 1) * E/n). A token goes
over the wire once to every rank hosting at least one of its experts, never once per expert.
The receiver copies it locally once per local expert (no wire bytes), and combine weights and
sums those copies before sending one row back, so each (token, rank) pair costs one row each way.

Wire traffic of one dispatch: one all_to_all of 4 int64 per rank pair (row counts, plus
num_experts, k and hidden size, so that ranks which disagree fail with Mismatch instead of
exchanging garbage), then the payload rows and the routing metadata (k expert ids and k
weights per row, as int32). A cached dispatch sends the payload only; combine sends the
weighted rows back.

Arrays: numpy or torch (CPU, and CUDA where the transport takes CUDA). The payload stays in
the caller's array library and device; the routing metadata (indices and counts, a few bytes
per token) is planned on the host in numpy, since split sizes must be known there anyway.
Weighted sums accumulate in float32 and round once to the payload dtype. Not differentiable
(torch results carry no autograd history): wrap dispatch / combine in an autograd.Function.
Each group keeps two wire buffers (rows sent, rows received) for reuse, grown as needed.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from .core.errors import InvalidArgument, Mismatch

# What each rank tells every peer before a dispatch: rows it sends, and the routing shape.
_COUNT_FIELDS = ("rows", "num_experts", "top-k", "hidden size")


# Weighted row sums run a slice of output rows at a time, sized so that the float32
# temporaries stay about this big: small enough for the allocator to recycle them instead of
# page-faulting fresh memory on every call, large enough that per-slice overhead is noise.
_CHUNK_BYTES = 8 << 20


# ---- array adapters: the few operations dispatch/combine need, per array library -----------------

class _NumpyOps:
    def take(self, x, rows, out=None):
        return np.take(x, rows, axis=0, out=out)

    def raw(self, like, nbytes: int):
        return np.empty(nbytes, np.uint8)

    def view(self, raw, like, shape):
        return raw[:int(np.prod(shape)) * like.dtype.itemsize].view(like.dtype).reshape(shape)

    def empty(self, like, shape, dtype: str | None = None):
        """Uninitialised [shape] of like's dtype, or of the named one ("int32", "int64")."""
        return np.empty(shape, like.dtype if dtype is None else dtype)

    def from_numpy(self, a: np.ndarray, like):
        return np.ascontiguousarray(a)

    def to_numpy(self, a) -> np.ndarray:
        return np.asarray(a)

    def plain(self, a):
        return a

    def sum_rows_into(self, dst, src, sel, local_rows, weights) -> None:
        """dst[local_rows[i]] = sum of weights[i] * src[sel[i]] (float32); local_rows sorted."""
        vals = src[sel].astype(np.float32)
        if weights is not None:
            vals *= weights[:, None]
        acc = np.zeros(dst.shape, np.float32)
        if len(sel):
            # Sorted rows make each output row a contiguous segment: reduceat beats np.add.at.
            starts = np.flatnonzero(np.r_[True, local_rows[1:] != local_rows[:-1]])
            acc[local_rows[starts]] = np.add.reduceat(vals, starts, axis=0)
        dst[...] = acc


class _TorchOps:
    def take(self, x, rows, out=None):
        import torch
        return torch.index_select(x, 0, self.from_numpy(rows, x), out=out)

    def raw(self, like, nbytes: int):
        import torch
        return like.new_empty(nbytes, dtype=torch.uint8)

    def view(self, raw, like, shape):
        return raw[:int(np.prod(shape)) * like.dtype.itemsize].view(like.dtype).view(shape)

    def empty(self, like, shape, dtype: str | None = None):
        import torch
        return like.new_empty(shape, dtype=like.dtype if dtype is None else getattr(torch, dtype))

    def from_numpy(self, a: np.ndarray, like):
        import torch
        return torch.from_numpy(np.ascontiguousarray(a)).to(like.device)

    def to_numpy(self, a) -> np.ndarray:
        return a.detach().cpu().numpy()

    def plain(self, a):
        """Without autograd history: the exchange moves bytes, it is not differentiable."""
        return a.detach()

    def sum_rows_into(self, dst, src, sel, local_rows, weights) -> None:
        import torch
        vals = src.index_select(0, sel)
        # bfloat16/float16 times float32 weights promotes to float32 in the same pass.
        vals = vals * weights[:, None] if weights is not None else vals.float()
        acc = torch.zeros(dst.shape, dtype=torch.float32, device=dst.device)
        acc.index_add_(0, local_rows, vals)
        dst.copy_(acc)


def _weighted_row_sum(ops, src, rows: np.ndarray, weights: np.ndarray | None, n: int, out=None):
    """out[r] = sum over i with rows[i] == r of weights[i] * src[i] (weights None: 1), as
    [n, hidden] in src's dtype (into `out` if given); accumulated in float32, rounded once."""
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    contributions_per_row = max(1, len(rows) // max(n, 1))
    step = max(1, _CHUNK_BYTES // max(1, contributions_per_row * src.shape[1] * 4))
    starts = range(0, n, step)
    bounds = np.searchsorted(sorted_rows, np.arange(0, n + step, step)).tolist()
    order_d, rows_d = ops.from_numpy(order, src), ops.from_numpy(sorted_rows, src)
    weights_d = None if weights is None else ops.from_numpy(weights[order], src)
    out = ops.empty(src, (n, src.shape[1])) if out is None else out
    for lo, hi, first in zip(bounds[:-1], bounds[1:], starts):
        ops.sum_rows_into(out[first:first + step], src, order_d[lo:hi], rows_d[lo:hi] - first,
                          None if weights_d is None else weights_d[lo:hi])
    return out


_NUMPY, _TORCH = _NumpyOps(), _TorchOps()

# The wire buffers (gathered rows to send, rows received) are kept per group and reused, as
# DeepEP keeps its Buffer: a fresh multi-MiB allocation per call costs page faults comparable
# to the copy into it. Two grow-only slots per group, array library and device, held while the
# group lives; combine reuses dispatch's (its rows go back the way they came, so sizes match).
_wire_buffers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _wire(group, ops, like, slot: str, shape):
    """A scratch [shape] array of like's dtype, library and device; valid until the next call."""
    pool = _wire_buffers.setdefault(group, {})
    key = (slot, type(ops), str(getattr(like, "device", "cpu")))
    nbytes = int(np.prod(shape)) * like.dtype.itemsize
    raw = pool.get(key)
    if raw is None or len(raw) < nbytes:
        raw = pool[key] = ops.raw(like, nbytes)
    return ops.view(raw, like, shape)


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch")


def _ops(group, op: str, a, what: str):
    if isinstance(a, np.ndarray):
        return _NUMPY
    if _is_torch(a):
        return _TORCH
    raise _bad(group, op, f"{what} must be a numpy array or a torch tensor, got {type(a).__name__}")


def _bad(group, op: str, cause: str) -> InvalidArgument:
    return InvalidArgument(cause, rank=group.rank, op=f"moe.{op}")


def _is_floating(a) -> bool:
    return a.dtype.is_floating_point if _is_torch(a) else np.issubdtype(a.dtype, np.floating)


# ---- public types ---------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class DispatchLayout:
    """Where each token goes (dispatch_layout's result; host-side numpy, int64 unless noted).

    tokens_per_rank   [group.size]        distinct tokens sent to each rank
    tokens_per_expert [num_experts]       (token, expert) pairs routed to each expert
    is_token_in_rank  [num_tokens, group.size] bool: token t goes to rank r
    """

    num_experts: int
    tokens_per_rank: np.ndarray
    tokens_per_expert: np.ndarray
    is_token_in_rank: np.ndarray


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """The routing of one dispatch, for combine and for cached dispatches (host-side numpy).

    Wire rows are packed in rank order, and in token order within a rank.
    send_splits / recv_splits  rows sent to / received from each rank
    send_token       [sum(send_splits)] int64: the token of each sent row
    expert_row       [sum(expert_counts)] int64: the received row behind each grouped row
    expert_weight    [sum(expert_counts)] float32: that row's top-k weight for its expert
    expert_counts    rows per local expert (grouped rows are expert-major)
    recv_topk_idx    [sum(recv_splits), k] int64: local expert ids, -1 where not on this rank
    recv_topk_weights [sum(recv_splits), k] float32: weights, 0 where not on this rank
    """

    rank: int
    group_size: int
    num_experts: int
    num_tokens: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    send_token: np.ndarray
    expert_row: np.ndarray
    expert_weight: np.ndarray
    expert_counts: tuple[int, ...]
    recv_topk_idx: np.ndarray
    recv_topk_weights: np.ndarray


@dataclass(frozen=True, eq=False)
class ExpertTokens:
    """What dispatch delivers to this rank's experts.

    x              [sum(expert_counts), hidden], the payload's dtype, library and device: the
                   rows of local expert e are x[offsets[e]:offsets[e + 1]]; a token routed to
                   two local experts appears once in each group
    expert_counts  tuple of num_experts // group.size ints: rows per local expert
    topk_idx       [num_received_tokens, k] int64 (x's library and device): local expert ids of
                   each distinct received token, -1 for experts on other ranks
    topk_weights   [num_received_tokens, k] float32: the matching weights, 0 where -1
    """

    x: object
    expert_counts: tuple[int, ...]
    topk_idx: object
    topk_weights: object

    def per_expert(self) -> list:
        """The rows of each local expert, as views of x."""
        bounds = np.concatenate([[0], np.cumsum(self.expert_counts)]).tolist()
        return [self.x[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# ---- layout ---------------------------------------------------------------------------------------

def _routing(group, op: str, topk_idx, num_experts) -> np.ndarray:
    """topk_idx as validated host int64 [num_tokens, k]."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
        raise _bad(group, op, f"num_experts must be a positive integer, got {num_experts!r}")
    if num_experts % group.size:
        raise _bad(group, op, f"{num_experts} experts cannot be placed evenly on {group.size} ranks; "
                              "use a multiple of the group size")
    idx = _ops(group, op, topk_idx, "topk_idx").to_numpy(topk_idx)
    if idx.ndim != 2 or idx.shape[1] < 1:
        raise _bad(group, op, f"topk_idx must have shape [num_tokens, k] with k >= 1, got {idx.shape}")
    if not np.issubdtype(idx.dtype, np.integer):
        raise _bad(group, op, f"topk_idx must hold integers, got {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx.min() < -1 or idx.max() >= num_experts):
        bad = idx[(idx < -1) | (idx >= num_experts)][0]
        raise _bad(group, op, f"topk_idx holds expert {bad}, outside [0, {num_experts}) "
                              "(-1 marks an unused slot)")
    return idx


def _layout(group, idx: np.ndarray, num_experts: int) -> DispatchLayout:
    per_rank = num_experts // group.size
    routed = idx >= 0
    dest = np.where(routed, idx // per_rank, group.size)  # unused slots land in a spare column
    in_rank = np.zeros((idx.shape[0], group.size + 1), bool)
    in_rank[np.arange(idx.shape[0])[:, None], dest] = True
    in_rank = np.ascontiguousarray(in_rank[:, :group.size])
    return DispatchLayout(num_experts, in_rank.sum(0, dtype=np.int64),
                          np.bincount(idx[routed], minlength=num_experts).astype(np.int64), in_rank)


def dispatch_layout(topk_idx, num_experts: int, group) -> DispatchLayout:
    """Count where tokens go, without communicating.

    topk_idx     [num_tokens, k] int32/int64 (numpy or torch, any device): global expert ids in
                 [0, num_experts), -1 for an unused slot
    num_experts  total experts, a multiple of group.size (rank r hosts a contiguous block)
    group        the expert-parallel Communicator
    """
    return _layout(group, _routing(group, "dispatch_layout", topk_idx, num_experts), num_experts)


# ---- dispatch ---------------------------------------------------------------------------------------

def dispatch(group, x, topk_idx=None, topk_weights=None, num_experts: int | None = None,
             layout: DispatchLayout | None = None, *, handle: DispatchHandle | None = None):
    """Send each token to the ranks hosting its experts; returns (ExpertTokens, DispatchHandle).

    x             [num_tokens, hidden] float32, bfloat16 or float16 (numpy or torch; CUDA
                  where the transport takes it); num_tokens may be 0
    topk_idx      [num_tokens, k] int32/int64: global expert ids, -1 for an unused slot
    topk_weights  [num_tokens, k] floating (carried as float32): the gate weight of each slot
    num_experts   total experts, a multiple of group.size
    layout        dispatch_layout(topk_idx, num_experts, group), if already computed
    handle        a previous dispatch's handle: resend with that routing (pass no routing);
                  only the payload is exchanged
    Collective over `group`: every rank calls it, with the same num_experts, k and hidden.
    """
    op = "dispatch"
    ops = _ops(group, op, x, "x")
    x = ops.plain(x)
    if getattr(x, "ndim", None) != 2 or not _is_floating(x):
        raise _bad(group, op, f"x must be a floating [num_tokens, hidden] array, got shape "
                              f"{tuple(getattr(x, 'shape', ()))} of {getattr(x, 'dtype', type(x).__name__)}")
    if handle is None:
        handle = _route(group, ops, x, topk_idx, topk_weights, num_experts, layout)
    else:
        if topk_idx is not None or topk_weights is not None or layout is not None:
            raise _bad(group, op, "pass either a handle or the routing (topk_idx, topk_weights), not both")
        _check_handle(group, op, handle)
        if x.shape[0] != handle.num_tokens:
            raise _bad(group, op, f"x has {x.shape[0]} tokens but the handle routed {handle.num_tokens}")
    send = ops.take(x, handle.send_token, out=_wire(group, ops, x, "send", (len(handle.send_token), x.shape[1])))
    recv = _wire(group, ops, x, "recv", (sum(handle.recv_splits), x.shape[1]))
    group.all_to_all(recv, send, handle.recv_splits, handle.send_splits)
    tokens = ExpertTokens(ops.take(recv, handle.expert_row), handle.expert_counts,
                          ops.from_numpy(handle.recv_topk_idx, x), ops.from_numpy(handle.recv_topk_weights, x))
    return tokens, handle


def _route(group, ops, x, topk_idx, topk_weights, num_experts, layout) -> DispatchHandle:
    """Plan the send side, exchange counts and metadata, plan the receive side."""
    op = "dispatch"
    if topk_idx is None or topk_weights is None or num_experts is None:
        raise _bad(group, op, "topk_idx, topk_weights and num_experts are required without a handle")
    idx = _routing(group, op, topk_idx, num_experts)
    weights = _ops(group, op, topk_weights, "topk_weights").to_numpy(topk_weights)
    if idx.shape[0] != x.shape[0] or weights.shape != idx.shape:
        raise _bad(group, op, f"x {tuple(x.shape)}, topk_idx {idx.shape} and topk_weights "
                              f"{weights.shape} must be [num_tokens, hidden], [num_tokens, k], [num_tokens, k]")
    if not np.issubdtype(weights.dtype, np.floating):
        raise _bad(group, op, f"topk_weights must be floating, got {weights.dtype}")
    if layout is None:
        layout = _layout(group, idx, num_experts)
    elif layout.num_experts != num_experts or layout.is_token_in_rank.shape != (idx.shape[0], group.size):
        raise _bad(group, op, "layout was computed for other routing (num_experts or token count differ)")

    # Rows to rank r: its tokens in token order. nonzero over [rank, token] is rank-major.
    _, send_token = np.nonzero(layout.is_token_in_rank.T)
    send_splits = tuple(int(c) for c in layout.tokens_per_rank)
    k = idx.shape[1]
    recv_splits = _exchange_counts(group, ops, x, send_splits, (num_experts, k, x.shape[1]))

    # Metadata rows: k expert ids then k weights, all int32 (weights bit-cast) for one exchange.
    meta = np.empty((len(send_token), 2 * k), np.int32)
    meta[:, :k] = idx[send_token]
    meta[:, k:] = weights[send_token].astype(np.float32).view(np.int32)
    recv_meta = ops.empty(x, (sum(recv_splits), 2 * k), "int32")
    group.all_to_all(recv_meta, ops.from_numpy(meta, x), recv_splits, send_splits)
    recv_meta = ops.to_numpy(recv_meta)

    per_rank = num_experts // group.size
    local = recv_meta[:, :k].astype(np.int64) - group.rank * per_rank
    is_local = (recv_meta[:, :k] >= 0) & (local >= 0) & (local < per_rank)
    local = np.where(is_local, local, -1)
    recv_weights = np.where(is_local, recv_meta[:, k:].view(np.float32), np.float32(0))
    # Grouped rows: expert-major, then in received order (stable sort keeps row order).
    rows, slots = np.nonzero(is_local)
    experts = local[rows, slots]
    order = np.argsort(experts, kind="stable")
    return DispatchHandle(
        rank=group.rank, group_size=group.size, num_experts=num_experts, num_tokens=x.shape[0],
        send_splits=send_splits, recv_splits=recv_splits, send_token=send_token.astype(np.int64),
        expert_row=rows[order].astype(np.int64), expert_weight=recv_weights[rows, slots][order],
        expert_counts=tuple(int(c) for c in np.bincount(experts, minlength=per_rank)),
        recv_topk_idx=local, recv_topk_weights=recv_weights)


def _exchange_counts(group, ops, x, send_splits, shape: tuple[int, int, int]) -> tuple[int, ...]:
    """The one small all_to_all: rows each peer sends here, checked against the routing shape."""
    mine = np.array([[rows, *shape] for rows in send_splits], np.int64)
    theirs = ops.empty(x, (group.size, len(_COUNT_FIELDS)), "int64")
    group.all_to_all(theirs, ops.from_numpy(mine, x))
    theirs = ops.to_numpy(theirs)
    for peer in range(group.size):
        for field, want, got in zip(_COUNT_FIELDS[1:], shape, theirs[peer, 1:]):
            if got != want:
                raise Mismatch(f"rank {peer} dispatches with {field} {got}, this rank with {want}; "
                               "every rank must use the same", rank=group.rank, op="moe.dispatch")
    return tuple(int(c) for c in theirs[:, 0])


def _check_handle(group, op: str, handle) -> None:
    if not isinstance(handle, DispatchHandle):
        raise _bad(group, op, f"handle must be a DispatchHandle from moe.dispatch, got {type(handle).__name__}")
    if (handle.rank, handle.group_size) != (group.rank, group.size):
        raise _bad(group, op, f"the handle was made by rank {handle.rank} of a group of {handle.group_size}, "
                              f"not rank {group.rank} of {group.size}")


# ---- combine ------------------------------------------------------------------------------------------

def combine(group, expert_out, handle: DispatchHandle):
    """Send expert outputs back and sum them per token, weighted by the top-k weights.

    expert_out  [sum(expert_counts), hidden_out] floating (float32, bfloat16, float16; numpy or
                torch): the experts' outputs in dispatch's grouped row order (hidden_out may
                differ from the dispatched hidden size, but must be equal on every rank)
    handle      the DispatchHandle of the dispatch these rows came from
    Returns y [num_tokens, hidden_out], expert_out's dtype, library and device:
    y[t] = sum over slots j of topk_weights[t, j] * expert_{topk_idx[t, j]}(x[t]); 0 for a
    token with no expert. Collective over `group`.
    """
    op = "combine"
    ops = _ops(group, op, expert_out, "expert_out")
    expert_out = ops.plain(expert_out)
    _check_handle(group, op, handle)
    rows = len(handle.expert_row)
    if getattr(expert_out, "ndim", None) != 2 or expert_out.shape[0] != rows or not _is_floating(expert_out):
        raise _bad(group, op, f"expert_out must be a floating [{rows}, hidden] array (one row per "
                              f"dispatched row), got shape {tuple(getattr(expert_out, 'shape', ()))} "
                              f"of {getattr(expert_out, 'dtype', '?')}")
    # Weight and sum a token's local-expert rows here, so it travels back once per rank.
    hidden = expert_out.shape[1]
    partial = _weighted_row_sum(ops, expert_out, handle.expert_row, handle.expert_weight, sum(handle.recv_splits),
                                out=_wire(group, ops, expert_out, "recv", (sum(handle.recv_splits), hidden)))
    back = _wire(group, ops, expert_out, "send", (len(handle.send_token), hidden))
    group.all_to_all(back, partial, handle.send_splits, handle.recv_splits)
    return _weighted_row_sum(ops, back, handle.send_token, None, handle.num_tokens)
