"""comm.moe: expert-parallel dispatch / combine.

A reference MoE layer (router, top-k, experts, weighted combine) computed in this process must
equal the same layer run expert-parallel with dispatch / combine on 1..4 real rank processes;
routing properties (identity experts give the input back, each token crosses the wire once per
rank) are checked with hypothesis on real processes (the session's persistent rank pools).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from comm import moe
from comm.communicator import Communicator
from comm.core.errors import InvalidArgument, Mismatch
from reference import HAVE_TORCH
from transports import base

NATIVE_REASON = base.unavailable_reason("native")
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"native: {NATIVE_REASON}")


# ---- the reference MoE layer ------------------------------------------------------------------

HIDDEN = 16
EXPERTS = 12                 # divisible by 1, 2, 3 and 4 ranks
UNUSED = (3, 4, 5)           # the router never picks these: on 4 ranks, rank 1 receives nothing


def layer_params(seed: int = 7):
    rng = np.random.default_rng(seed)
    router = rng.standard_normal((HIDDEN, EXPERTS)).astype(np.float32)
    weights = (rng.standard_normal((EXPERTS, HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    return router, weights


def route(x: np.ndarray, router: np.ndarray, k: int):
    """Top-k of the router logits; softmax over the chosen k."""
    logits = x @ router
    logits[:, list(UNUSED)] = -np.inf
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    chosen = np.take_along_axis(logits, idx, 1)
    w = np.exp(chosen - chosen.max(1, keepdims=True))
    return idx.astype(np.int64), (w / w.sum(1, keepdims=True)).astype(np.float32)


def expert(e: int, h: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return np.tanh(h.astype(np.float32) @ weights[e])


def reference_layer(x: np.ndarray, k: int) -> np.ndarray:
    router, weights = layer_params()
    idx, w = route(x, router, k)
    y = np.zeros_like(x)
    for t in range(len(x)):
        for j in range(k):
            y[t] += w[t, j] * expert(idx[t, j], x[t:t + 1], weights)[0]
    return y


def rank_tokens(rank: int, size: int) -> np.ndarray:
    """Rank 1 of a multi-rank group has no tokens (a rank that sends none)."""
    n = 0 if (size > 1 and rank == 1) else 5 + 3 * rank
    return np.random.default_rng(100 + rank).standard_normal((n, HIDDEN)).astype(np.float32)


KINDS = [("numpy", "float32"), ("torch", "bfloat16"), ("numpy", "float16"), ("torch", "float32")]
if not HAVE_TORCH:   # the torch cases go; numpy float16 is the 2-byte float left
    KINDS = [k for k in KINDS if k[0] == "numpy"]
LAYER_KIND = ("torch", "bfloat16") if HAVE_TORCH else ("numpy", "float16")
TOL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


def _as(a: np.ndarray, kind: str, dtype: str):
    if kind == "numpy":
        return a.astype(dtype)
    import torch
    return torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dtype))


def _np32(a) -> np.ndarray:
    return a.astype(np.float32) if isinstance(a, np.ndarray) else a.float().numpy()


def ep_layer(world, k: int, kind: str, dtype: str):
    """The layer, expert-parallel: route locally, dispatch, run local experts, combine."""
    router, weights = layer_params()
    x = rank_tokens(world.rank, world.size)
    idx, w = route(x, router, k)
    recv, handle = moe.dispatch(world, _as(x, kind, dtype), _as(idx, kind, "int64"), w, EXPERTS)
    first = world.rank * (EXPERTS // world.size)
    outs = [expert(first + e, _np32(rows), weights) for e, rows in enumerate(recv.per_expert())]
    out = np.concatenate(outs) if outs else np.zeros((0, HIDDEN), np.float32)
    y = moe.combine(world, _as(out, kind, dtype), handle)
    return _np32(y), recv.expert_counts, sum(handle.send_splits)


def ep_layer_all(world):
    return {(k, kind, dtype): ep_layer(world, k, kind, dtype) for k in (1, 2, 4) for kind, dtype in KINDS}


def _check_layer(results, size):
    for (k, kind, dtype), _ in results[0].items():
        counts = np.concatenate([r[(k, kind, dtype)][1] for r in results])
        assert counts.sum() == sum(len(rank_tokens(r, size)) for r in range(size)) * k
        assert not counts[list(UNUSED)].any(), "an expert the router never picks received tokens"
        for rank, res in enumerate(results):
            y, _, sent = res[(k, kind, dtype)]
            x = rank_tokens(rank, size)
            assert sent <= len(x) * min(k, size), "a token crossed the wire more than once per rank"
            np.testing.assert_allclose(y, reference_layer(x, k), atol=TOL[dtype], rtol=TOL[dtype],
                                       err_msg=f"{size} ranks, top-{k}, {kind} {dtype}, rank {rank}")


# ---- pure, single-process --------------------------------------------------------------------


class _Group:
    """dispatch_layout needs only the group's rank and size."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_layout_counts_tokens_once_per_rank():
    idx = np.array([[0, 1], [2, 3], [1, 3], [-1, 0], [-1, -1]])
    layout = moe.dispatch_layout(idx, 4, _Group(0, 2))       # experts 0,1 on rank 0; 2,3 on rank 1
    assert layout.tokens_per_expert.tolist() == [2, 2, 1, 2]
    assert layout.is_token_in_rank.tolist() == [[True, False], [False, True], [True, True],
                                                [True, False], [False, False]]
    assert layout.tokens_per_rank.tolist() == [3, 2]


@pytest.mark.parametrize("idx, experts, match", [
    (np.zeros((3,), np.int64), 4, "shape"),
    (np.array([[0, 4]]), 4, "outside"),
    (np.array([[0, -2]]), 4, "outside"),
    (np.array([[0.0, 1.0]]), 4, "integers"),
    (np.array([[0, 1]]), 3, "evenly"),
    (np.array([[0, 1]]), 0, "positive"),
])
def test_layout_rejects_bad_routing(idx, experts, match):
    with pytest.raises(InvalidArgument, match=match) as e:
        moe.dispatch_layout(idx, experts, _Group(1, 2))
    assert e.value.rank == 1 and e.value.op == "moe.dispatch_layout"


# ---- routing on real processes -----------------------------------------------------------------


def _identity_roundtrip(world, cases):
    """Dispatch, identity experts, combine: weights summing to one give x back."""
    x, idx, w = cases[world.rank]
    recv, handle = moe.dispatch(world, x, idx, w, cases[-1])
    y = moe.combine(world, recv.x, handle)
    routed = (idx >= 0).any(1)
    return np.abs(y[routed] - x[routed]).max(initial=0), np.abs(y[~routed]).max(initial=0), \
        sum(handle.send_splits), int(moe.dispatch_layout(idx, cases[-1], world).is_token_in_rank.sum())


@st.composite
def routings(draw, ranks=st.integers(1, 4)):
    n = draw(ranks)
    experts = n * draw(st.integers(1, 3))
    k = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n):
        tokens = int(rng.integers(0, 7))
        idx = rng.integers(-1, experts, (tokens, k))
        w = np.where(idx >= 0, rng.random((tokens, k)) + 0.1, 0).astype(np.float32)
        w /= np.maximum(w.sum(1, keepdims=True), 1e-9)
        cases.append((rng.standard_normal((tokens, 8)).astype(np.float32), idx, w))
    return n, cases + [experts]


@needs_native
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(routings())
def test_identity_experts_return_the_input(cluster, case):
    n, cases = case
    for err, unrouted, sent, pairs in cluster(n).run(_identity_roundtrip, cases):
        assert err < 1e-5 and unrouted == 0
        assert sent == pairs, "each token goes once to each rank hosting one of its experts"


def _grouping(world):
    # 2 ranks, 4 experts: rank 0 hosts 0,1; rank 1 hosts 2,3. Rank 0's token 0 picks experts
    # 1 and 0 (both on rank 0): it arrives once at rank 0 and feeds both local experts.
    x = np.arange(3 * 2, dtype=np.float32).reshape(3, 2) + 10 * world.rank
    idx = np.array([[1, 0], [2, 3], [3, -1]]) if world.rank == 0 else np.array([[0, 2], [-1, -1], [1, 1]])
    w = np.full(idx.shape, 0.5, np.float32)
    recv, handle = moe.dispatch(world, x, idx, w, 4)
    return recv, handle.recv_splits, handle.send_splits


@needs_native
def test_receiver_groups_by_local_expert(cluster):
    (r0, recv_splits0, send0), (r1, recv_splits1, send1) = cluster(2).run(_grouping)
    assert send0 == (1, 2) and send1 == (2, 1)          # rank 1's token 1 goes nowhere
    assert recv_splits0 == (1, 2) and recv_splits1 == (2, 1)
    assert r0.expert_counts == (2, 3)                    # expert 0: t0, r1.t0; expert 1: t0, r1.t2 x2
    assert r0.x.tolist() == [[0, 1], [10, 11], [0, 1], [14, 15], [14, 15]]
    assert r0.topk_idx.tolist() == [[1, 0], [0, -1], [1, 1]]
    assert r0.topk_weights.tolist() == [[0.5, 0.5], [0.5, 0], [0.5, 0.5]]
    assert r1.expert_counts == (2, 2)                    # expert 2: t1, r1.t0; expert 3: t1, t2
    assert r1.x.tolist() == [[2, 3], [10, 11], [2, 3], [4, 5]]


def _cached(world):
    x = np.random.default_rng(world.rank).standard_normal((6, 4)).astype(np.float32)
    idx = np.random.default_rng(9 + world.rank).integers(0, 6, (6, 2))
    w = np.full(idx.shape, 0.5, np.float32)
    first, handle = moe.dispatch(world, x, idx, w, 6)
    calls = []
    world.all_to_all = lambda *a, **kw: calls.append(a) or Communicator.all_to_all(world, *a, **kw)
    second, again = moe.dispatch(world, 2 * x, handle=handle)
    y = moe.combine(world, second.x, handle)
    return np.array_equal(second.x, 2 * first.x), again is handle, len(calls), np.abs(y - 2 * x).max()


@needs_native
def test_cached_dispatch_sends_only_the_payload(cluster):
    for same, reused, calls, err in cluster(3).run(_cached):
        assert same and reused and err < 1e-5
        assert calls == 2    # the payload of the cached dispatch, and combine: no count exchange


def _bad_calls(world):
    x = np.zeros((4, 8), np.float32)
    idx = np.zeros((4, 2), np.int64)
    w = np.full((4, 2), 0.5, np.float32)
    recv, handle = moe.dispatch(world, x, idx, w, 2)
    errors = []
    for call in (lambda: moe.dispatch(world, x, idx[:3], w, 2),
                 lambda: moe.dispatch(world, x.astype(np.int32), idx, w, 2),
                 lambda: moe.dispatch(world, x, idx, w.astype(np.int32), 2),
                 lambda: moe.dispatch(world, x, idx, w, 2, handle=handle),
                 lambda: moe.dispatch(world, x[:2], handle=handle),
                 lambda: moe.dispatch(world, [[1.0]], idx, w, 2),
                 lambda: moe.combine(world, recv.x.reshape(-1), handle),
                 lambda: moe.combine(world, recv.x, (1, 2))):
        try:
            call()
        except InvalidArgument as e:
            errors.append(str(e))
    return errors


@needs_native
def test_bad_arguments_are_refused_before_sending(cluster):
    errors = cluster(2).run(_bad_calls)[1]
    assert len(errors) == 8, errors
    assert all(e.startswith("[rank 1] moe.") for e in errors), errors


def _requires_grad(world):
    import torch
    x = torch.randn(4, 8, requires_grad=True)
    idx = torch.tensor([[0, 1], [1, 2], [3, -1], [2, 0]])
    recv, handle = moe.dispatch(world, x * 1, idx, torch.full((4, 2), 0.5), 4)
    y = moe.combine(world, recv.x.requires_grad_(), handle)
    routed = torch.tensor([1.0, 1.0, 0.5, 1.0])[:, None]
    return float((y - x.detach() * routed).abs().max())


@needs_native
def test_torch_tensors_that_require_grad_are_exchanged_without_history(cluster):
    pytest.importorskip("torch")
    assert max(cluster(2).run(_requires_grad)) < 1e-6


def _disagree(world):
    x = np.zeros((2, 4 + world.rank), np.float32)
    try:
        moe.dispatch(world, x, np.zeros((2, 1), np.int64), np.ones((2, 1), np.float32), 2)
    except Mismatch as e:
        return str(e)


@needs_native
def test_ranks_that_disagree_on_the_routing_shape_fail_with_mismatch(cluster):
    errors = cluster(2).run(_disagree)
    assert "rank 1 dispatches with hidden size 5" in errors[0]
    assert "rank 0 dispatches with hidden size 4" in errors[1]


# ---- the layer on every transport --------------------------------------------------------------

# Other transports get the 3-rank layer; native gets every rank count.
OTHER_TRANSPORTS = {"mpi": "mpirun", "ucx": "spawn"}


def _skip_unless(name: str):
    reason = base.unavailable_reason(name)
    return pytest.mark.skip(reason=f"{name}: {reason}") if reason else []


@pytest.mark.parametrize("transport, launcher, n",
                         [pytest.param("native", "spawn", n, marks=_skip_unless("native")) for n in (1, 2, 3, 4)]
                         + [pytest.param(name, launcher, 3, marks=_skip_unless(name))
                            for name, launcher in OTHER_TRANSPORTS.items()])
def test_expert_parallel_layer_equals_reference(cluster, transport, launcher, n):
    _check_layer(cluster(n, transport, launcher).run(ep_layer_all), n)


def _cuda_layer(world):
    import torch
    router, weights = layer_params()
    x = rank_tokens(world.rank, world.size)
    idx, w = route(x, router, 2)
    cuda = lambda a: torch.from_numpy(a).cuda()
    recv, handle = moe.dispatch(world, cuda(x).bfloat16(), cuda(idx), cuda(w), EXPERTS)
    first = world.rank * (EXPERTS // world.size)
    outs = [expert(first + e, _np32(rows.cpu()), weights) for e, rows in enumerate(recv.per_expert())]
    y = moe.combine(world, cuda(np.concatenate(outs)).bfloat16(), handle)
    assert y.is_cuda and recv.x.is_cuda and recv.topk_idx.is_cuda
    return _np32(y.cpu()), recv.expert_counts, sum(handle.send_splits)


@pytest.mark.skipif(bool(base.unavailable_reason("nccl")), reason=f"nccl: {base.unavailable_reason('nccl')}")
def test_expert_parallel_layer_on_cuda(cluster):
    import torch
    n = min(torch.cuda.device_count(), 2)
    results = cluster(n, "nccl").run(_cuda_layer)
    _check_layer([{(2, "torch", "bfloat16"): r} for r in results], n)


# ---- the benchmark (bench/benchmarks/moe.py): both implementations deliver exact results ----

def bench_moe(rank, size):
    import io

    from bench import cli
    out = io.StringIO()
    rc = cli.main(["moe_dispatch", "moe_combine", "moe", "-d", "bfloat16", "-b", "256K", "-e", "256K",
                   "--transport", "native,gloo", "-n", "1", "-w", "1"], out=out, err=io.StringIO())
    return rc, out.getvalue()


@pytest.mark.skipif(bool(base.unavailable_reason("native")), reason="native transport unavailable")
@pytest.mark.skipif(not HAVE_TORCH, reason="the anchor (gloo) and bfloat16 need torch")
def test_benchmark_checks_clean_against_the_naive_gloo_exchange():
    from harness import run_ranks
    (rc, text), _ = run_ranks(bench_moe, 2, init=False, timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert rc == 0, text
    rows = [r for r in (line.split() for line in text.splitlines() if line.startswith("      262144")) if len(r) > 8]
    assert len(rows) == 6 and all(r[8] == "0" for r in rows), text
    assert ("# Comparison: moe bfloat16: busbw (GB/s), out-of-place, median of 3 interleaved repetitions, "
            "ratio range in (); ratio = speed relative to gloo") in text
