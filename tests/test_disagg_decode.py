"""examples/disagg_decode.py: a Hugging Face Llama served by a prefill rank and a decode rank that
moves each request's KV cache with one-sided puts; its tokens must be identical to the same
model generating the whole request in one process (the example compares and exits 1 otherwise).
Every case is slow (each rank imports torch and transformers: about 15 s for two ranks here)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from harness import ROOT, mpirun

from transports import base

pytest.importorskip("transformers", reason="the example serves a transformers Llama: pip install transformers")

EXAMPLE = os.path.join(ROOT, "examples", "disagg_decode.py")
TINY = ["--requests", "3", "--new-tokens", "6", "--prompt", "20,70", "--layers", "2", "--hidden", "64",
        "--heads", "4", "--kv-heads", "2", "--block-tokens", "8"]


def _run(*flags: str, env: dict | None = None, timeout: float = 240) -> str:
    e = dict(os.environ, COMM_TIMEOUT="60", **(env or {}))
    r = subprocess.run([sys.executable, EXAMPLE, *flags, *TINY], capture_output=True, text=True,
                       timeout=timeout, env=e)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "tokens identical to one-process generation: 3 of 3" in r.stdout, r.stdout
    return r.stdout


def _mpi_missing() -> str | None:
    return "no mpirun" if mpirun() is None else base.unavailable_reason("mpi")


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["native", "mpi"])
def test_tokens_identical_on_one_host(transport):
    if transport == "mpi":
        if _mpi_missing():
            pytest.skip(f"mpi: {_mpi_missing()}")
        out = _run("--np", "2", "--mpirun")
    else:
        out = _run("--np", "2", env={"COMM_TRANSPORT": transport})
    assert f"transport {transport}" in out


@pytest.mark.slow
def test_two_decode_ranks_and_tcp():
    """One prefill rank feeding two decode ranks (a pool each), over the TCP channel."""
    out = _run("--np", "3", "--prefill", "1", env={"COMM_TRANSPORT": "native", "COMM_CHANNELS": "tcp"})
    assert {int(m) for m in re.findall(r"^\s+\d+\s+0\s+(\d+)\s", out, re.M)} == {1, 2}, out


@pytest.mark.slow
def test_across_two_simulated_hosts():
    from bench.cluster import unavailable
    if unavailable():
        pytest.skip(f"simulated hosts: {unavailable()}")
    out = _run("--np", "2", "--hosts", "2", "--link-rate", "2gbit")
    assert "longest block wait / link time" in out
