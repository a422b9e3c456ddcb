"""Where the ranks come from, and the control channel the benchmark itself uses.

Launchers: mpirun (Open MPI, MPICH/Hydra), torchrun, Slurm srun -- all read through
comm.bootstrap.rendezvous.detect() -- and self-launch: `python -m bench --np N ...` starts N local ranks
with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port) and a
fresh COMM_SECRET. When mpi-raw is among the transports and an mpirun is found (next to this
Python first, then on PATH), self-launch starts the ranks under that mpirun instead, so the MPI
anchor runs too; --no-mpirun keeps plain processes (mpi-raw then reports "needs mpirun").

The control channel is a comm.bootstrap.store.Store hosted by rank 0 on MASTER_PORT (under torchrun, whose
agent already serves a store there, that store): timings, #wrong
and errors are gathered through it, never through the transport being measured, and every
transport gets a fresh port from it for its own rendezvous.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from comm.core import config
from comm.bootstrap import rendezvous

MPI_LAUNCHERS = ("openmpi", "hydra")


@dataclass
class World:
    rank: int
    size: int
    addr: str
    port: int
    launcher: str


def placement() -> World:
    """Rank, size and the rendezvous address, from whichever launcher started us."""
    place = rendezvous.detect()
    if place.rank is None or place.size is None:
        return World(0, 1, "127.0.0.1", rendezvous.free_port(), "single")
    if place.launcher in MPI_LAUNCHERS and (place.master_addr is None or place.master_port is None):
        from transports.mpi import share_address_through_mpi   # lazily: only this path needs MPI
        place = share_address_through_mpi(place)
    addr = place.master_addr or "127.0.0.1"
    port = place.master_port if place.master_port is not None else rendezvous.DEFAULT_PORT
    return World(place.rank, place.size, addr, port, place.launcher)


class TorchAgentStore:
    """torchrun's own TCPStore on MASTER_PORT (its agent hosts it), used as a client with the
    few calls Control needs."""

    def __init__(self, world: World, timeout: float):
        import torch.distributed as dist
        self._store = dist.TCPStore(world.addr, world.port, world.size, is_master=False,
                                    timeout=datetime.timedelta(seconds=timeout))
        self._prefix = f"comm-bench/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.rank, self.size = world.rank, world.size

    def set(self, key: str, value: bytes) -> None:
        self._store.set(self._prefix + key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(self._prefix + key))

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        self.set(f"{key}/{self.rank}", value)
        return [value if r == self.rank else self.get(f"{key}/{r}") for r in range(self.size)]

    def close(self) -> None:
        """The agent owns the server."""


class StepFailed(Exception):
    """Some rank failed; raised on every rank at the same point (the message names them)."""


class Control:
    """Small all-gathers of JSON values between ranks, through the bootstrap store.

    A rank that fails posts an error marker in place of its value at its next gather; every
    rank then sees it at the same gather and raises StepFailed, so all ranks leave together.
    """

    def __init__(self, world: World, timeout: float):
        from comm.bootstrap.store import Store
        secret = config.get("COMM_SECRET")
        self.world = world
        self._seq = 0
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            self.store = TorchAgentStore(world, timeout)   # torchrun already listens on MASTER_PORT
        else:
            self.store = Store.host_or_connect(world.addr, world.port, rank=world.rank, size=world.size,
                                               timeout=timeout, secret=secret.encode() if secret else None,
                                               bind_addr=rendezvous.bind_address())

    def gather(self, value) -> list:
        """Every rank's `value` (JSON-able), in rank order. Ranks must call it in the same order."""
        self._seq += 1
        raw = self.store.all_gather(f"bench/{self._seq}", json.dumps(value).encode())
        values = [json.loads(v) for v in raw]
        errors = [f"rank {r}: {v['error']}" for r, v in enumerate(values) if isinstance(v, dict) and "error" in v]
        if errors:
            raise StepFailed("; ".join(errors))
        return values

    def fail(self, error: BaseException):
        """Tell every rank this one failed (raises StepFailed here too)."""
        self.gather({"error": f"{type(error).__name__}: {error}".strip()})
        raise StepFailed(str(error))

    def fresh_port(self) -> int:
        """A port rank 0 found free, for the next transport's rendezvous."""
        return self.gather(rendezvous.free_port() if self.world.rank == 0 else None)[0]

    def close(self) -> None:
        """Rank 0 keeps serving until every other rank has said it needs the store no more."""
        if self.world.rank != 0:
            self.store.set(f"bench/closed/{self.world.rank}", b"")
        else:
            for r in range(1, self.world.size):
                self.store.get(f"bench/closed/{r}")
        self.store.close()


def launched() -> bool:
    """True when a launcher (mpirun, torchrun, srun, or our own self-launch) started this process."""
    return rendezvous.detect().size is not None


def find_mpirun() -> str | None:
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return local if os.access(local, os.X_OK) else shutil.which("mpirun")


def _mpirun_command(mpirun: str, n: int) -> list[str]:
    cmd = [mpirun]
    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    if "Open MPI" in version:
        cmd += ["--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd + ["-np", str(n)]


def _child_env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("COMM_SECRET", secrets.token_hex(16))
    # as torchrun does: N ranks each running torch's default thread pool oversubscribe the cores
    env.setdefault("OMP_NUM_THREADS", "1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def passive_rma_env(env: dict) -> dict:
    """Open MPI's MCA settings for one-sided operations that progress without the target.

    Open MPI serves MPI_Win_create with osc/ucx only on RDMA devices (opal_common_ucx_tls); on a
    machine without one it takes osc/rdma, which emulates RMA with messages that the target
    must answer from inside MPI: a put + flush waited 1 s for a target that slept 1 s, and the
    bench's ranks, meeting between rows outside MPI, could wait on each other for good. So
    where no RDMA device exists and the user set none of these, osc/ucx serves shared memory
    and TCP too (the same put + flush: 0.05 ms), and pml stays ob1, what Open MPI picks here
    anyway, so two-sided numbers do not change."""
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        return env
    keys = ("OMPI_MCA_osc", "OMPI_MCA_pml", "OMPI_MCA_opal_common_ucx_tls", "OMPI_MCA_opal_common_ucx_devices")
    if any(k in env for k in keys):
        return env
    return dict(env, **dict(zip(keys, ("ucx", "ob1", "any", "any"))))


def self_launch(argv: list[str], n: int, use_mpirun: bool) -> int:
    """Run `python -m bench argv` as n local ranks; returns the job's exit status."""
    env = _child_env()
    env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(rendezvous.free_port())
    child = [sys.executable, "-m", "bench"] + argv
    mpirun = find_mpirun() if use_mpirun else None
    if mpirun:
        cmds = [(_mpirun_command(mpirun, n) + child, passive_rma_env(env))]
    else:
        cmds = [(child, dict(env, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                             LOCAL_WORLD_SIZE=str(n))) for r in range(n)]
    return _run_ranks(lambda: [subprocess.Popen(cmd, env=e, start_new_session=True) for cmd, e in cmds])


def launch_on_hosts(argv: list[str], hosts: int, per_host: int, link_rate: str | None, err) -> int:
    """Run `python -m bench argv` as per_host ranks on each of `hosts` simulated hosts
    (bench.cluster), their links limited to link_rate; returns the job's exit status."""
    from .cluster import NetnsCluster, unavailable
    why = unavailable()
    if why:
        print(f"--hosts: {why}", file=err)
        return 2
    child = [sys.executable, "-m", "bench"] + argv
    with NetnsCluster(hosts, link_rate) as cluster:   # a fresh namespace: every port is free
        # gloo takes the address the host name resolves to (loopback here) unless told
        env = dict(_child_env(), GLOO_SOCKET_IFNAME=cluster.dev)
        return _run_ranks(lambda: cluster.launch(child, per_host, env, master_port=rendezvous.DEFAULT_PORT))


def _run_ranks(start) -> int:
    """Start the ranks (start() returns their processes) and wait for them all."""
    procs: list[subprocess.Popen] = []

    def stop(signum, frame):   # killed ourselves (timeout, scheduler): take the ranks along
        _kill(procs)
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        procs += start()
        return _wait_all(procs)
    except KeyboardInterrupt:
        _kill(procs)
        return 130


def _wait_all(procs: list[subprocess.Popen]) -> int:
    """Wait for every rank; once one fails, give the others a grace period, then kill them."""
    status, failed_at = 0, None
    while any(p.poll() is None for p in procs):
        for p in procs:
            if p.returncode not in (None, 0) and failed_at is None:
                status, failed_at = p.returncode, time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 10:
            _kill(procs)
            break
        time.sleep(0.05)
    codes = [p.wait() for p in procs]
    return status or next((c for c in codes if c), 0)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
