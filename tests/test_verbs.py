"""Verbs transport: the engine over RDMA verbs (native/src/verbs.cc).

What needs no RDMA device runs everywhere: the wire format, credit accounting, the stream in
slots, address records and GID choice are C++ (native/src/verbs_wire.cc), checked by
native/tests/verbs_wire_test.cc, which this builds with the system compiler; discovery must say why verbs cannot run. A run over
queue pairs needs an active RDMA port and skips with the reason discovery gives."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

import comm
from harness import ROOT
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


def test_wire_credits_address_and_gid_choice(tmp_path):
    """native/tests/verbs_wire_test.cc, built with warnings as errors and sanitizers: immediates,
    credits, the stream in slots (sizes across slots, a header mismatch before any payload byte,
    drained splits, a header read apart from its body), address records, GID choice."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler here to build native/tests/verbs_wire_test.cc")
    exe = str(tmp_path / "verbs_wire_test")
    native = os.path.join(ROOT, "native")
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined",
                            os.path.join(native, "tests", "verbs_wire_test.cc"),
                            *(os.path.join(native, "src", f) for f in ("verbs_wire.cc", "channel.cc", "common.cc")),
                            "-o", exe],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "all checks passed" in run.stdout


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
    from comm import config
    assert config.get("COMM_VERBS_HOP_LIMIT") == 64
    monkeypatch.setenv("COMM_VERBS_HOP_LIMIT", "8")
    assert config.get("COMM_VERBS_HOP_LIMIT") == 8
    from transports.verbs import VerbsTransport
    assert VerbsTransport.net_options()["hop_limit"] == "8"


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
