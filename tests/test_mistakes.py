"""A user's set-up mistakes get a clear answer within seconds, on every rank: ranks that
disagree on the world size, the transport or COMM_SECRET; RANK without WORLD_SIZE; bad COMM_*
values; and a half-started job that rank 0 reports while it waits. Real processes, real sockets."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import comm
from comm.bootstrap.store import Store
from harness import ROOT, free_port
from transports import base

needs_native = pytest.mark.skipif(base.unavailable_reason("native") is not None,
                                  reason=f"native: {base.unavailable_reason('native')}")

JOB = """
import sys, time, numpy as np, comm
t0 = time.monotonic()
try:
    world = comm.init()
    x = np.full(4, float(world.rank + 1))
    world.all_reduce(x)
    print(f"rank {world.rank} result {x[0]:.0f}", flush=True)
    world.close()
except comm.CommError as e:
    print(f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    sys.exit(3)
"""


TORCH_JOB = """
import datetime, sys, time, torch, torch.distributed as dist, comm
t0 = time.monotonic()
try:
    dist.init_process_group("comm", timeout=datetime.timedelta(seconds=6))
    dist.all_reduce(torch.ones(4))
except comm.CommError as e:
    print(f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    sys.exit(3)
"""


def launch(per_rank_env: list[dict], timeout: float = 60, job: str = JOB, **common) -> list[tuple[int, str, str]]:
    """Run JOB once per entry of per_rank_env (each laid over a shared base); returns
    (returncode, stdout, stderr) per process."""
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    base_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), COMM_TIMEOUT="60",
                    PYTHONPATH=os.pathsep.join([ROOT, base_env.get("PYTHONPATH", "")]))
    base_env.update(common)
    procs = [subprocess.Popen([sys.executable, "-c", job], env={**base_env, **env}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for env in per_rank_env]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout, stderr))
    return out


def _failed_fast(results, pattern: str, within: float = 10.0) -> None:
    for rc, stdout, stderr in results:
        assert rc == 3, stdout + stderr
        assert pattern in stdout, stdout + stderr
        seconds = float(stdout.split(" after ")[1].split(" s")[0])
        assert seconds < within, stdout


@needs_native
def test_world_size_disagreement_fails_every_rank_fast():
    results = launch([{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "3"}])
    _failed_fast(results, "Mismatch")
    for _, stdout, _ in results:
        assert "disagree on the world size: rank 0 has 2, rank 1 (from 127.0.0.1) has 3" in stdout


@needs_native
def test_secret_only_on_a_client_fails_every_rank_fast():
    """Rank 0 has no secret (so nothing to protect): a rank with one tells everybody."""
    results = launch([{"RANK": "0", "WORLD_SIZE": "2"},
                      {"RANK": "1", "WORLD_SIZE": "2", "COMM_SECRET": "s3cret"}])
    _failed_fast(results, "COMM_SECRET")
    assert "has COMM_SECRET set but rank 0 has not" in results[0][1]
    assert "disagrees on COMM_SECRET (it is set here)" in results[1][1]


@needs_native
@pytest.mark.slow
def test_different_secrets_under_torch_are_named():
    """init_process_group("comm") rendezvous over torch's store, which has no secret: the data
    connections' handshake is where two secrets meet. The rank whose proof is refused says
    so at once; rank 0 (which cannot trust an unauthenticated claim to end the job) names the
    failed handshakes in its timeout."""
    pytest.importorskip("torch")
    results = launch([{"RANK": "0", "WORLD_SIZE": "2", "COMM_SECRET": "one"},
                      {"RANK": "1", "WORLD_SIZE": "2", "COMM_SECRET": "two"}], job=TORCH_JOB)
    rc1, out1, err1 = results[1]
    assert rc1 == 3 and "its COMM_SECRET differs from this rank's" in out1, out1 + err1
    assert float(out1.split(" after ")[1].split(" s")[0]) < 5
    rc0, out0, err0 = results[0]
    assert rc0 == 3 and "CommTimeout" in out0, out0 + err0
    assert "1 connection(s) failed the handshake (a rank started with another COMM_SECRET" in out0, out0


@needs_native
@pytest.mark.slow
def test_secret_missing_on_a_client():
    """Rank 0 has a secret, rank 1 not: rank 1 fails at once; rank 0 cannot trust an
    unauthenticated claim to end the job, so it reports the refusal while it waits and in
    its timeout."""
    results = launch([{"RANK": "0", "WORLD_SIZE": "2", "COMM_SECRET": "s3cret"},
                      {"RANK": "1", "WORLD_SIZE": "2"}], COMM_TIMEOUT="6", COMM_REPORT_INTERVAL="1")
    rc1, out1, _ = results[1]
    assert rc1 == 3 and "refused us: server disagrees on COMM_SECRET (it is not set here)" in out1, out1
    assert float(out1.split(" after ")[1].split(" s")[0]) < 5
    rc0, out0, err0 = results[0]
    assert rc0 == 3 and "CommTimeout" in out0, out0
    assert "ranks 1 of 2 have not joined" in out0 and "127.0.0.1 (no COMM_SECRET)" in out0, out0
    assert "dropped connections from 127.0.0.1 (no COMM_SECRET)" in err0, err0


@needs_native
@pytest.mark.skipif(base.unavailable_reason("ucx") is not None, reason=f"ucx: {base.unavailable_reason('ucx')}")
def test_transport_disagreement_fails_every_rank_fast():
    results = launch([{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2", "COMM_TRANSPORT": "ucx"}])
    _failed_fast(results, "ranks disagree on the transport: rank 0 has 'native', rank 1 (from 127.0.0.1) has 'ucx'")


def test_transport_disagreement_answers_everyone():
    port = free_port()
    host = Store.host_or_connect("127.0.0.1", port, rank=0, size=3, timeout=20, secret=None,
                                 agree={"transport": "native"})
    errors = {}

    def waiting_rank():
        try:   # a rank that agrees and already waits for the others
            Store("127.0.0.1", port, rank=1, size=3, timeout=20, secret=None,
                  agree={"transport": "native"}).get("never-set")
        except comm.CommError as e:
            errors[1] = e

    t = threading.Thread(target=waiting_rank)
    t.start()
    time.sleep(0.3)
    start = time.monotonic()
    with pytest.raises(comm.Mismatch, match="disagree on the transport: rank 0 has 'native', rank 2"):
        Store("127.0.0.1", port, rank=2, size=3, timeout=20, secret=None, agree={"transport": "ucx"})
    with pytest.raises(comm.Mismatch, match="disagree on the transport"):
        host.get("never-set")
    t.join(10)
    assert isinstance(errors.get(1), comm.Mismatch), errors
    assert time.monotonic() - start < 5
    host.close()


def test_two_processes_claiming_one_rank():
    port = free_port()
    host = Store.host_or_connect("127.0.0.1", port, rank=0, size=3, timeout=20, secret=None)
    first = Store("127.0.0.1", port, rank=1, size=3, timeout=20, secret=None)
    with pytest.raises(comm.Mismatch, match="two processes claim rank 1"):
        Store("127.0.0.1", port, rank=1, size=3, timeout=20, secret=None)
    with pytest.raises(comm.Mismatch, match="two processes claim rank 1"):
        first.get("x")
    first.close()
    host.close()


@pytest.mark.parametrize("env,missing", [({"RANK": "1"}, "WORLD_SIZE"), ({"WORLD_SIZE": "2"}, "RANK")])
def test_rank_without_world_size(monkeypatch, env, missing):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    start = time.monotonic()
    with pytest.raises(comm.InvalidArgument, match=f"set {missing}"):
        comm.init(timeout=5)
    assert time.monotonic() - start < 2


@needs_native
def test_rank_0_reports_missing_ranks_while_it_waits():
    """Rank 2 of 3 never comes: rank 0 says so every COMM_REPORT_INTERVAL seconds, and every
    rank's timeout names it."""
    results = launch([{"RANK": "0", "WORLD_SIZE": "3"}, {"RANK": "1", "WORLD_SIZE": "3"}],
                     COMM_TIMEOUT="5", COMM_REPORT_INTERVAL="1")
    rc0, out0, err0 = results[0]
    reports = [line for line in err0.splitlines() if line.startswith("comm: rank 0 has waited")]
    assert len(reports) >= 2, err0
    assert "ranks 2 of 3 have not joined the rendezvous at 127.0.0.1:" in reports[-1], reports
    assert "joined: ranks 0-1 from 127.0.0.1" in reports[-1], reports
    for rc, out, err in results:
        assert rc == 3 and "CommTimeout" in out and "ranks 2 of 3 have not joined" in out, out + err
    assert "has waited" not in results[1][2], "only rank 0 reports"


@pytest.mark.parametrize("var,value,accepts", [
    ("COMM_TIMEOUT", "5m", "a positive number of seconds"),
    ("COMM_TIMEOUT", "-1", "a positive number of seconds"),
    ("COMM_ALGO", "rings", "ring"),
    ("COMM_CHANNELS", "shm", "one of auto, tcp"),
    ("COMM_SOCKETS_PER_PEER", "0", "an integer >= 1"),
    ("COMM_CHUNK_BYTES", "1M", "an integer >= 1"),
    ("COMM_TRANSPORT", "nccl2", "one of native, mpi"),
    ("COMM_DEBUG", "yes", "0 or 1"),
    ("COMM_MPI_BOUNDED", "2", "0 or 1"),
    ("COMM_BIND_ADDR", "eth0", "an IPv4 or IPv6 address"),
    ("COMM_VERBS_GID_INDEX", "x", "an integer >= -1"),
    ("COMM_REPORT_INTERVAL", "soon", "a number of seconds >= 0"),
])
def test_bad_config_value(monkeypatch, var, value, accepts):
    monkeypatch.setenv(var, value)
    with pytest.raises(comm.InvalidArgument) as info:
        comm.init(timeout=5)
    message = str(info.value)
    assert f"{var}={value!r} is not valid: expected" in message and accepts in message, message


def test_bad_algorithm_lists_every_transports_names(monkeypatch):
    monkeypatch.setenv("COMM_ALGO", "rings")
    with pytest.raises(comm.InvalidArgument) as info:
        comm.init(timeout=5)
    message = str(info.value)
    if base.unavailable_reason("native") is None:
        from comm import _native
        assert f"native, ucx, verbs: {', '.join(_native.algorithm_names())}" in message, message
        assert "cma" in _native.algorithm_names() and "pairwise" in _native.algorithm_names()


def test_empty_value_means_default(monkeypatch):
    monkeypatch.setenv("COMM_TIMEOUT", "")
    with comm.init() as world:
        assert world.timeout == 300


@needs_native
def test_debug_logs_set_up_and_algorithms():
    results = launch([{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}], COMM_DEBUG="1")
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0 and f"rank {rank} result 3" in out, out + err
        assert f"comm[rank {rank}]: init: rank {rank} of 2" in err, err
        assert f"joined the rendezvous at 127.0.0.1:" in err, err
        assert f"comm[rank {rank}]: world: connected" in err, err
        assert "shared memory with ranks" in err, err
        assert f"comm[rank {rank}]: world: all_reduce uses algorithm " in err, err
    assert "store: serving the rendezvous on 127.0.0.1:" in results[0][2]


@needs_native
def test_no_debug_output_by_default():
    results = launch([{"RANK": "0", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}])
    for rc, out, err in results:
        assert rc == 0 and "comm[rank" not in err, out + err
