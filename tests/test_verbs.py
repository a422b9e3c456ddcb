"""Verbs transport: the engine over RDMA verbs (native/src/channels/verbs/verbs.cc).

What needs no RDMA device runs everywhere: the wire format, credit accounting, the stream in
slots, address records and GID choice are C++ (native/src/channels/verbs/verbs_wire.cc), checked by
native/tests/verbs_wire_test.cc, and the keys, chunks and completion accounting of windows over
RDMA WRITE / READ (native/src/windows/window_verbs_plan.cc) by native/tests/window_verbs_plan_test.cc,
both built here with CMake, linking the engine library; discovery must say why verbs cannot run. A run over
queue pairs needs an active RDMA port and skips with the reason discovery gives."""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

import comm
from harness import build_native_test
from transports import base

VERBS_REASON = base.unavailable_reason("verbs")
BUILT_WITHOUT = VERBS_REASON is not None and "built without" in VERBS_REASON


def _libibverbs_loads() -> bool:
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return False
    return True


def _rdma_devices_listed() -> bool:
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


@pytest.mark.slow   # links the engine library built with sanitizers: about 90 s on 2 cores, once
def test_wire_credits_address_and_gid_choice():
    """native/tests/verbs_wire_test.cc, built with warnings as errors and sanitizers: immediates,
    credits, the stream in slots (sizes across slots, a header mismatch before any payload byte,
    drained splits, a header read apart from its body), address records, GID choice."""
    out = build_native_test("verbs_wire_test")
    assert "all checks passed" in out


@pytest.mark.slow   # links the engine library built with sanitizers: about 90 s on 2 cores, once
def test_window_keys_chunks_and_completions():
    """native/tests/window_verbs_plan_test.cc: the device-free half of windows over RDMA WRITE /
    READ (native/src/windows/window_verbs_plan.cc): the window key (round trip; short, long, foreign and
    wrapping keys refused), range checks at the window's edges, work-request ids apart from the
    channel's own, chunk cutting, and chunks in flight against a model (stray completions,
    failures kept for the next flush, abandoned READs, a lost queue pair)."""
    out = build_native_test("window_verbs_plan_test")
    assert "window_verbs_plan: all checks passed" in out


def test_discovery_says_why_verbs_cannot_run():
    if VERBS_REASON is None:
        pytest.skip("an RDMA port is active here: this checks the message given without one")
    causes = ("built without", "libibverbs.so.1", "no RDMA device", "no active RDMA port", "COMM_VERBS_DEVICE")
    assert any(c in VERBS_REASON for c in causes), VERBS_REASON
    with pytest.raises(comm.TransportUnavailable, match="transport 'verbs' cannot run here"):
        comm.init(transport="verbs")


def test_engine_built_without_verbs_names_the_headers():
    if not BUILT_WITHOUT:
        pytest.skip("the engine was built with the verbs net (rdma-core's headers were present)")
    assert "libibverbs-dev" in VERBS_REASON


def test_missing_library_names_the_package():
    if BUILT_WITHOUT or _libibverbs_loads():
        pytest.skip("needs an engine built with the verbs net on a machine without libibverbs.so.1")
    assert "apt-get install libibverbs1 rdma-core" in VERBS_REASON


def test_no_device_is_named():
    if BUILT_WITHOUT or not _libibverbs_loads() or _rdma_devices_listed():
        pytest.skip("needs the verbs net and libibverbs.so.1 on a machine without an RDMA device")
    assert "no RDMA device" in VERBS_REASON


def test_hop_limit_is_declared_and_configurable(monkeypatch):
    from comm.core import config
    assert config.get("COMM_VERBS_HOP_LIMIT") == 64
    monkeypatch.setenv("COMM_VERBS_HOP_LIMIT", "8")
    assert config.get("COMM_VERBS_HOP_LIMIT") == 8
    from transports.verbs import VerbsTransport
    assert VerbsTransport.net_options()["hop_limit"] == "8"


def test_window_rma_follows_its_variable(monkeypatch):
    """COMM_WINDOW_RMA=1 opens the verbs net with windows over RDMA WRITE / READ, as UCX's."""
    from transports.verbs import VerbsTransport
    monkeypatch.delenv("COMM_WINDOW_RMA", raising=False)
    assert VerbsTransport.net_options()["rma"] == "0"
    monkeypatch.setenv("COMM_WINDOW_RMA", "1")
    assert VerbsTransport.net_options()["rma"] == "1"


def test_engine_has_the_verbs_window_when_built_with_verbs():
    """Built where rdma-core's headers were present, the engine holds the verbs windows
    (window_verbs.cc compiled under COMM_HAVE_VERBS: one of its messages is in the module);
    built without, it holds none of it. (The module is stripped: its text is what is left.)"""
    from comm._native import _native as module   # the compiled module (comm/_native/ is its folder)
    with open(module.__file__, "rb") as f:
        has = b"has no verbs window key" in f.read()
    assert has == (not BUILT_WITHOUT), "built without verbs" if BUILT_WITHOUT else "window_verbs.cc missing"


def _ring_exchange(world, device="cpu"):
    """An all_reduce (collective stream), a send/recv around the ring (p2p stream)."""
    if device == "cuda":
        import torch
        x = torch.full((1000,), float(world.rank + 1), device="cuda")
        world.all_reduce(x)
        first = float(x[0])
    else:
        x = np.full(1000, world.rank + 1, np.float32)
        world.all_reduce(x)
        first = float(x[0])
    peer = (world.rank + 1) % world.size
    got = np.empty(17, np.int64)
    r = world.irecv(got, (world.rank - 1) % world.size, tag=5)
    world.send(np.arange(17, dtype=np.int64) + world.rank, peer, tag=5)
    r.wait()
    return first, int(got[0])


@pytest.mark.skipif(VERBS_REASON is not None, reason=f"verbs: {VERBS_REASON}")
def test_two_ranks_over_verbs():
    from harness import run_ranks
    results = run_ranks(_ring_exchange, 2, transport="verbs", timeout=120)
    assert results == [(3.0, 1), (3.0, 0)]


def _window_over_rdma(world):
    """Rank r writes rank r+1's window by RDMA WRITE (the whole of it, through more staging
    chunks than a window has, then its last byte and a signal) and reads it back by RDMA READ."""
    n, me = world.size, world.rank
    size = (6 << 20) + 5 + 8 * me   # past 4 MiB of staging (32 chunks of 128 KiB), not a chunk multiple
    buf = np.zeros(size, np.uint8)
    peer, prev = (me + 1) % n, (me - 1) % n
    with world.window(buf, signals=2) as w:
        assert [p for r, p in enumerate(w._tw.paths) if r != me] == ["rma"] * (n - 1), w._tw.paths
        src = ((np.arange(w.sizes[peer], dtype=np.int64) * 7 + me) % 251).astype(np.uint8)
        w.put(peer, src)
        w.put(peer, np.full(1, 250, np.uint8), w.sizes[peer] - 1, signal=1)
        w.wait_signal(1, 1, timeout=30)
        want = ((np.arange(size, dtype=np.int64) * 7 + prev) % 251).astype(np.uint8)
        want[-1] = 250
        assert np.array_equal(buf, want)
        world.barrier()
        back = np.zeros(w.sizes[peer], np.uint8)
        w.get(peer, back)
        w.flush(peer)
        src[-1] = 250
        assert np.array_equal(back, src)
        w.fence()
    return True


@pytest.mark.skipif(VERBS_REASON is not None, reason=f"verbs: {VERBS_REASON}")
def test_window_over_rdma_write_and_read():
    from harness import run_ranks
    env = {"COMM_WINDOW_RMA": "1", "COMM_CMA": "0"}   # one host: no CMA, so the NIC carries it
    assert run_ranks(_window_over_rdma, 2, transport="verbs", env=env, timeout=120) == [True, True]
