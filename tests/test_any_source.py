"""Receives from any rank (src=None, MPI_ANY_SOURCE) on the native engine: the first message of
the tag from any peer completes the receive and names its sender; per (peer, tag) order and
the earlier-posted receive's claim on a message still hold; a missing sender times out."""
import time

import numpy as np
import pytest

import comm

CHANNELS = ["auto", "tcp"]


def _env(channels, timeout="30"):
    return {"COMM_CHANNELS": channels, "COMM_TIMEOUT": timeout}


def _from_everyone(world):
    """Rank 0 receives one message from each peer through receives from any rank, some posted
    before the messages arrive, some after (parked); the others send two tagged messages
    each, the second after a delay, in rank order."""
    n = world.size
    if world.rank == 0:
        early = [world.irecv(np.zeros(3, np.float32), None, tag=5) for _ in range(n - 1)]
        world.barrier()
        got = []
        for w in early:
            w.wait()
            got.append(w.source)
        world.barrier()
        time.sleep(0.3)  # the second round is parked by now
        late = []
        for _ in range(n - 1):
            buf = np.zeros(3, np.float32)
            src = world.recv(buf, None, tag=6)
            assert buf.tolist() == [float(src)] * 3
            late.append(src)
        return sorted(got), sorted(late)
    world.barrier()
    world.send(np.full(3, float(world.rank), np.float32), 0, tag=5)
    world.barrier()
    time.sleep(0.05 * world.rank)
    world.send(np.full(3, float(world.rank), np.float32), 0, tag=6)
    return None


@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("n", [2, 4])
def test_any_source_names_the_sender(cluster, n, channels):
    results = cluster(n, env=_env(channels)).run(_from_everyone)
    peers = list(range(1, n))
    assert results[0] == (peers, peers)


def _order_and_claims(world):
    """Per-peer order: two messages from rank 1 with one tag arrive in order through receives
    from any rank. Claims: a receive from rank 1 posted before a receive from any rank gets
    rank 1's message; the later receive from any rank gets the next one."""
    if world.rank == 1:
        for k in range(4):
            world.send(np.full(2, float(k), np.float32), 0, tag=9)
        return None
    a, b = np.zeros(2, np.float32), np.zeros(2, np.float32)
    wa, wb = world.irecv(a, None, tag=9), world.irecv(b, None, tag=9)
    wa.wait(), wb.wait()
    c, d = np.zeros(2, np.float32), np.zeros(2, np.float32)
    wc = world.irecv(c, 1, tag=9)            # posted first: gets message 2
    wd = world.irecv(d, None, tag=9)         # gets message 3
    wd.wait(), wc.wait()
    return [a[0], b[0], c[0], d[0]], [wa.source, wb.source, wd.source]


@pytest.mark.parametrize("channels", CHANNELS)
def test_any_source_keeps_order_and_earlier_claims(cluster, channels):
    values, sources = cluster(2, env=_env(channels)).run(_order_and_claims)[0]
    assert values == [0.0, 1.0, 2.0, 3.0] and sources == [1, 1, 1]


def _nobody_sends(world):
    if world.rank == 0:
        start = time.monotonic()
        with pytest.raises(comm.CommTimeout, match="not completed"):
            world.recv(np.zeros(1, np.float32), None, tag=3)
        return time.monotonic() - start
    return None


def test_any_source_times_out(cluster):
    took = cluster(2, env=_env("auto", timeout="2")).run(_nobody_sends)[0]
    assert took < 20
