"""`python -m comm.doctor`: every section is there, and a missing optional package is named
with why (the package hidden as on a machine without it); COMM_DEBUG=1 prints the same at init."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from harness import HERE, ROOT
from transports import base

SECTIONS = ("transports:", "native engine:", "UCX:", "RDMA devices:", "GPUs:", "shared memory and limits:")


def _doctor(hidden: str = "") -> str:
    argv = [sys.executable, os.path.join(HERE, "hide_packages.py"), hidden, "-m", "comm.doctor"] if hidden \
        else [sys.executable, "-m", "comm.doctor"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_every_section_and_what_is_here():
    out = _doctor()
    for title in SECTIONS:
        assert f"\n{title}\n" in out, out
    for name in base.names():
        reason = base.unavailable_reason(name)
        assert f"  {name}: {reason or 'available'}" in out, out
    assert "/dev/shm:" in out and "locked memory (ulimit -l):" in out and "ptrace_scope" in out, out
    if base.unavailable_reason("ucx") is None:
        assert "net ucx (library=" in out and "capabilities: host memory yes" in out, out
        assert "transport tcp:" in out, out   # ucx_info -d lists UCX's own transports
        # the UCX found, where, and that it is in the engine's range (tests/test_ucx_versions.py
        # runs older and unsupported ones)
        assert re.search(r"\n  libucp: UCX 1\.\d+\.\d+ \(/\S*libucp\.so[.0-9]*\): supported \(the engine runs on "
                         r"UCX 1\.\d+ or a newer 1\.x\)\n", out), out


@pytest.mark.skipif(base.unavailable_reason("ucx") is not None, reason=f"ucx: {base.unavailable_reason('ucx')}")
def test_without_libucx_says_why():
    out = _doctor("libucx")
    assert "  ucx: the libucx wheel cannot be loaded (No module named 'libucx'); pip install libucx-cu12" in out, out
    assert "net ucx: unavailable: the libucx wheel cannot be loaded" in out, out
    assert "libucx is not installed" in out, out
    assert "  native: available" in out, out


def test_rdma_section_without_pyverbs():
    """verbs is the engine's net: pyverbs hidden changes nothing, the section says what it sees."""
    out = _doctor("pyverbs")
    reason = base.unavailable_reason("verbs")
    assert f"  verbs: {reason or 'available'}" in out, out
    section = out.split("\nRDMA devices:\n", 1)[1].split("\nGPUs:", 1)[0]
    assert (reason or "active") in section, out


def test_debug_prints_it_at_init():
    code = "import comm; comm.init(rank=0, world_size=1).close()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, "COMM_DEBUG": "1"})
    assert done.returncode == 0, done.stderr
    for title in SECTIONS:
        assert f"comm[rank 0]: {title}" in done.stderr, done.stderr
