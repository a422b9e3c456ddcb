"""The native transport's own doors: shared-memory segments and the data-connection listener.

Segments are created exclusively with mode 0600 under unguessable names; strangers that connect
to a rank's listener during set-up with random or truncated bytes, or with a wrong secret, are
dropped, and the real job still connects and computes correctly."""
from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import comm
from comm.bootstrap import auth, rendezvous
from comm.bootstrap.store import Store
from harness import free_port, slow
from transports import base

pytestmark = pytest.mark.skipif(base.unavailable_reason("native") is not None,
                                reason=f"native: {base.unavailable_reason('native')}")


def _engine():
    from comm import _native
    return _native.Engine(0, 2, [0, 1], 5.0, "", 1 << 19, 32 << 10)


def test_shm_segment_anonymous_and_private():
    engine = _engine()
    before = set(os.listdir("/dev/shm"))
    try:
        fd = engine.shm_create()
        # memfd: no name in /dev/shm that a stranger could pre-create, open, or find left over
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        assert set(os.listdir("/dev/shm")) - before == set()
        assert stat.S_IMODE(os.stat(f"/proc/self/fd/{fd}").st_mode) == 0o600
        assert not os.get_inheritable(fd)   # not passed on to exec'd programs
    finally:
        engine.close()


def _stranger(addr: str, port: int, payload: bytes, secret: bytes | None) -> None:
    """Connect to a rank's data listener and misbehave in one of several ways."""
    try:
        with socket.create_connection((addr, port), timeout=5) as s:
            s.settimeout(5)
            if secret is not None:               # a well-formed handshake with a wrong secret
                auth.client_handshake(s, secret, 5)
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while s.recv(4096):
                pass
    except (OSError, auth.HandshakeError):
        pass                                     # being dropped is the expected outcome


def _listener_of_rank0(spy: Store) -> dict:
    """Rank 0's published data listener, read the way an insider of the store would, before
    rank 1 exists: the spy posts rank 1's host id, so rank 0 gets past the topology gather
    and publishes its listener (rank 1 posts the same id again when it arrives)."""
    spy.set("world/topology/1", rendezvous.host_id().encode())
    try:
        return json.loads(spy.get("world/native/info/0"))
    finally:
        spy.close()


def _rank(rank: int, port: int, results: dict) -> None:
    try:
        with comm.init(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                       timeout=30) as world:
            x = np.full(1000, float(rank + 1), np.float32)
            world.all_reduce(x)
            results[rank] = float(x[0])
    except BaseException as e:  # reported by the test thread
        results[rank] = e


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.one_of(st.binary(max_size=200), st.just(auth.MAGIC[:3]),
                         st.builds(lambda t: auth.MAGIC + b"\1" + t, st.binary(max_size=100))),
       wrong_secret=st.booleans())
def test_strangers_on_the_data_listener(monkeypatch, payload, wrong_secret):
    monkeypatch.setenv("COMM_SECRET", "the-real-secret")
    port, results = free_port(), {}
    rank0 = threading.Thread(target=_rank, args=(0, port, results))
    rank0.start()
    # read rank 0's published listener the way an insider of the store would
    spy = Store("127.0.0.1", port, rank=1, size=2, timeout=20, secret=b"the-real-secret")
    info = _listener_of_rank0(spy)
    # rank 0 accepts only once rank 1 has arrived, so the strangers queue up ahead of rank 1
    strangers = [threading.Thread(target=_stranger, args=(info["addr"], info["port"], payload,
                                                          b"wrong" if wrong_secret else None))
                 for _ in range(3)]
    for t in strangers:
        t.start()
    rank1 = threading.Thread(target=_rank, args=(1, port, results))
    rank1.start()
    for t in [rank0, rank1] + strangers:
        t.join(60)
    assert results == {0: 3.0, 1: 3.0}, results


def _lingering_stranger(addr: str, port: int, kind: str, hold: float, stop: threading.Event) -> None:
    """Connect and stay: `idle` sends nothing, `garbage` sends bytes that are not the protocol,
    `slow` trickles the protocol's hello one byte a second. None of them hangs up."""
    try:
        with socket.create_connection((addr, port), timeout=5) as s:
            if kind == "garbage":
                s.sendall(secrets.token_bytes(64))
            for i in range(int(hold)):
                if stop.wait(1):
                    break
                if kind == "slow" and i < len(auth.MAGIC):
                    s.sendall(auth.MAGIC[i:i + 1])
    except OSError:
        pass  # being dropped is fine


@pytest.mark.parametrize("secret", [None, *slow("the-real-secret")])
def test_lingering_strangers_do_not_stall_setup(monkeypatch, secret):
    """Strangers that connect to a rank's data listener during set-up and then stall,
    trickle or send garbage without hanging up: init still completes on every rank, in far
    less than the timeout (handshakes run concurrently, each under a short deadline)."""
    if secret:
        monkeypatch.setenv("COMM_SECRET", secret)
    else:
        monkeypatch.delenv("COMM_SECRET", raising=False)
    port, results, stop = free_port(), {}, threading.Event()
    start = time.monotonic()
    rank0 = threading.Thread(target=_rank, args=(0, port, results))
    rank0.start()
    spy = Store("127.0.0.1", port, rank=1, size=2, timeout=20,
                secret=secret.encode() if secret else None)
    info = _listener_of_rank0(spy)
    strangers = [threading.Thread(target=_lingering_stranger,
                                  args=(info["addr"], info["port"], kind, 60, stop))
                 for kind in ("idle", "idle", "garbage", "slow", "idle")]
    for t in strangers:
        t.start()
    time.sleep(0.3)  # the strangers are queued ahead of rank 1's connections
    rank1 = threading.Thread(target=_rank, args=(1, port, results))
    rank1.start()
    rank0.join(60)
    rank1.join(60)
    elapsed = time.monotonic() - start
    stop.set()
    for t in strangers:
        t.join(10)
    assert results == {0: 3.0, 1: 3.0}, results
    # before: one idle stranger delayed init by the whole timeout (30 s), two failed it
    assert elapsed < 15, f"set-up took {elapsed:.1f} s with strangers on the listener"


@pytest.mark.parametrize("connect", ["eager", "lazy"])
def test_data_listener_closed_after_setup(cluster, connect):
    """Once every peer a rank will ever talk to is connected, no data listener is left open for
    strangers to reach: under eager after the mesh, under lazy where the plan holds every peer
    (one host). A lazy listener kept for connections on first use (ranks on several hosts) is
    the acceptor that test_strangers_on_the_data_listener floods during set-up."""
    c = cluster(2, env={"COMM_CONNECT": connect})
    for addr, port in c.run(_listener_port):
        with pytest.raises(OSError):
            socket.create_connection((addr, port), timeout=2).close()
    assert c.run(_sum) == [3.0, 3.0]


def _sum(world):
    x = np.full(4, world.rank + 1.0)
    world.all_reduce(x)
    return float(x[0])


def _listener_port(world):
    info = json.loads(world.session.ctx.store.get(f"native/info/{world.rank}"))
    return info["addr"], info["port"]
