"""Pipeline point-to-point: batch_p2p, and two examples written with the public API only.

- a ring exchange (all-gather by n - 1 neighbour exchanges) listing its receives first, the
  order that deadlocks when posted as listed on a transport that runs its operations in order;
- 4-stage pipeline training with the 1F1B micro-batch schedule (Megatron's), whose losses and
  weight gradients equal the unsplit model's bit for bit (float64, same operation order).
"""
from __future__ import annotations

import numpy as np
import pytest

from comm import Communicator, InvalidArgument
from comm.p2p import P2POp
from transports import base

needs_native = pytest.mark.skipif(bool(base.unavailable_reason("native")),
                                  reason=f"native: {base.unavailable_reason('native')}")

# ---- batch_p2p itself --------------------------------------------------------------------


def _bad_batches(world):
    buf = np.zeros(4, np.float32)
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    other = 1 - world.rank
    errors = []
    for ops in ([P2POp("send", buf, other)],
                [P2POp("isend", buf, world.rank)],
                [P2POp("irecv", buf, 2)],
                [P2POp("isend", buf, other, tag=-1)],
                [P2POp("irecv", frozen, other)],
                [P2POp(print, buf, other)],
                [P2POp("isend", buf, other), ("irecv", buf, other)]):
        try:
            world.batch_p2p(ops)
        except InvalidArgument as e:
            errors.append(str(e))
    # Nothing of the refused batches was posted: a clean exchange still matches one to one
    # (a send posted by a refused batch would be what this receive gets).
    got = np.zeros(4, np.float32)
    for w in world.batch_p2p([P2POp(Communicator.isend, buf + world.rank, other),
                              P2POp(world.irecv, got, other)]):
        w.wait()
    return errors, got.tolist()


@needs_native
def test_batch_p2p_checks_every_op_before_posting_any(cluster):
    for rank, (errors, got) in enumerate(cluster(2).run(_bad_batches)):
        assert len(errors) == 7, errors
        assert all(e.startswith(f"[rank {rank}] batch_p2p: op ") for e in errors), errors
        assert got == [1 - rank] * 4


# ---- ring exchange (real processes) ---------------------------------------------------------

BLOCK = 1 << 18     # 1 MiB of float32 per block: big enough for a transport's rendezvous path


def ring_all_gather(world):
    """Each rank ends with every rank's block; every step lists its receive before its send."""
    n, r = world.size, world.rank
    blocks = np.zeros((n, BLOCK), np.float32)
    blocks[r] = np.arange(BLOCK, dtype=np.float32) + r
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        out, into = (r - step) % n, (r - step - 1) % n
        for work in world.batch_p2p([P2POp("irecv", blocks[into], left, tag=step),
                                     P2POp("isend", blocks[out], right, tag=step)]):
            work.wait()
    want = np.arange(BLOCK, dtype=np.float32)[None, :] + np.arange(n, dtype=np.float32)[:, None]
    return bool(np.array_equal(blocks, want))


@needs_native
@pytest.mark.parametrize("n", [2, 4])
def test_ring_exchange(cluster, n):
    assert all(cluster(n).run(ring_all_gather))


# ---- 1F1B pipeline (real processes) --------------------------------------------------------

STAGES, MICRO_BATCHES, BATCH, WIDTH = 4, 6, 3, 8
FWD, BWD = 0, 1     # tags: activations go forward, gradients backward


def stage_weights(s: int) -> np.ndarray:
    return np.random.default_rng(s).standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)


def micro_batch(m: int) -> np.ndarray:
    return np.random.default_rng(1000 + m).standard_normal((BATCH, WIDTH))


def layer_forward(w, x):
    return np.tanh(x @ w)


def layer_backward(w, x, y, grad_y):
    """(grad of x, grad of w) of y = tanh(x @ w)."""
    grad_z = grad_y * (1 - y * y)
    return grad_z @ w.T, x.T @ grad_z


def loss(y):
    """0.5 * |y|^2, whose gradient is y."""
    return 0.5 * float((y * y).sum())


def unsplit_model():
    """The same model in one process: losses per micro-batch, weight gradients per stage."""
    ws = [stage_weights(s) for s in range(STAGES)]
    grads = [np.zeros_like(w) for w in ws]
    losses = []
    for m in range(MICRO_BATCHES):
        acts = [micro_batch(m)]
        for w in ws:
            acts.append(layer_forward(w, acts[-1]))
        losses.append(loss(acts[-1]))
        g = acts[-1]
        for s in reversed(range(STAGES)):
            g, gw = layer_backward(ws[s], acts[s], acts[s + 1], g)
            grads[s] += gw
    return losses, grads


class Stage:
    """One pipeline stage: its layer, saved activations, and the p2p steps of the schedule."""

    def __init__(self, world):
        self.world, self.s = world, world.rank
        self.first, self.last = self.s == 0, self.s == world.size - 1
        self.w = stage_weights(self.s)
        self.grad_w = np.zeros_like(self.w)
        self.saved: list = []      # (x, y) per micro-batch in flight, oldest first
        self.losses: list = []
        self.next_input = 0

    def recv_forward(self):
        if self.first:
            self.next_input += 1
            return micro_batch(self.next_input - 1)
        x = np.empty((BATCH, WIDTH))
        self.world.recv(x, self.s - 1, FWD)
        return x

    def forward(self, x):
        y = layer_forward(self.w, x)
        self.saved.append((x, y))
        if self.last:
            self.losses.append(loss(y))
        return y

    def backward(self, grad_y):
        x, y = self.saved.pop(0)
        grad_x, grad_w = layer_backward(self.w, x, y, grad_y)
        self.grad_w += grad_w
        return grad_x

    def send_forward(self, y):
        if not self.last:
            self.world.send(y, self.s + 1, FWD)

    def recv_backward(self):
        if self.last:
            return self.saved[0][1]          # gradient of the loss of the oldest micro-batch
        g = np.empty((BATCH, WIDTH))
        self.world.recv(g, self.s + 1, BWD)
        return g

    def send_backward(self, g):
        if not self.first:
            self.world.send(g, self.s - 1, BWD)

    def send_forward_recv_backward(self, y):
        """Both at once: stage s + 1 is doing the mirror-image step with this stage."""
        if self.last:
            return self.recv_backward()
        g = np.empty((BATCH, WIDTH))
        _wait(self.world.batch_p2p([P2POp("isend", y, self.s + 1, FWD), P2POp("irecv", g, self.s + 1, BWD)]))
        return g

    def send_backward_recv_forward(self, g):
        if self.first:
            return self.recv_forward()
        x = np.empty((BATCH, WIDTH))
        _wait(self.world.batch_p2p([P2POp("isend", g, self.s - 1, BWD), P2POp("irecv", x, self.s - 1, FWD)]))
        return x


def _wait(works):
    for w in works:
        w.wait()


def one_f_one_b(world):
    """Warm-up forwards, then one forward / one backward, then cool-down backwards."""
    st = Stage(world)
    warmup = min(world.size - st.s - 1, MICRO_BATCHES)
    steady = MICRO_BATCHES - warmup
    for _ in range(warmup):
        st.send_forward(st.forward(st.recv_forward()))
    x = st.recv_forward() if steady else None
    for i in range(steady):
        g = st.send_forward_recv_backward(st.forward(x))
        grad_x = st.backward(g)
        if i == steady - 1:
            st.send_backward(grad_x)
        else:
            x = st.send_backward_recv_forward(grad_x)
    for _ in range(warmup):
        st.send_backward(st.backward(st.recv_backward()))
    assert not st.saved and st.next_input in (0, MICRO_BATCHES)
    return st.losses, st.grad_w


@needs_native
def test_one_f_one_b_pipeline_equals_unsplit_model(cluster):
    results = cluster(STAGES).run(one_f_one_b)
    losses, grads = unsplit_model()
    assert results[-1][0] == losses
    for s, (_, grad_w) in enumerate(results):
        np.testing.assert_array_equal(grad_w, grads[s], err_msg=f"stage {s}")
