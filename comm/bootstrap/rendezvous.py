"""Who am I: rank, world size and rendezvous address from the launcher's environment.

One small detector per launcher (modelled on jax's clusters/): each says whether it sees its
launcher and fills in what it knows. Explicit arguments to comm.init() win over all of them.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import random
import re
import socket
import struct
from dataclasses import dataclass

from ..core import config
from ..core.errors import InvalidArgument

DEFAULT_PORT = 29500


@dataclass
class Placement:
    rank: int | None = None
    size: int | None = None
    local_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "explicit"


def _int(env: dict, key: str) -> int | None:
    value = env.get(key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(f"environment variable {key}={value!r} is not an integer", op="init") from None


def _master(env: dict) -> tuple[str | None, int | None]:
    return env.get("MASTER_ADDR") or None, _int(env, "MASTER_PORT")


class Launcher:
    name = "?"

    @staticmethod
    def detect(env: dict) -> bool:
        raise NotImplementedError

    @staticmethod
    def placement(env: dict) -> Placement:
        raise NotImplementedError


class Torchrun(Launcher):
    name = "torchrun"

    @staticmethod
    def detect(env):
        return "RANK" in env and "WORLD_SIZE" in env

    @staticmethod
    def placement(env):
        return Placement(_int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"),
                         *_master(env), launcher="torchrun")


class OpenMPI(Launcher):
    name = "openmpi"

    @staticmethod
    def detect(env):
        return "OMPI_COMM_WORLD_RANK" in env

    @staticmethod
    def placement(env):
        return Placement(_int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), *_master(env), launcher="openmpi")


class Hydra(Launcher):
    """MPICH / Intel MPI's Hydra process manager (PMI_RANK, PMI_SIZE)."""

    name = "hydra"

    @staticmethod
    def detect(env):
        return "PMI_RANK" in env and "PMI_SIZE" in env

    @staticmethod
    def placement(env):
        return Placement(_int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                         _int(env, "MPI_LOCALRANKID"), *_master(env), launcher="hydra")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list such as 'gpu[003-010,12],cpu1' -> 'gpu003'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise InvalidArgument(f"cannot parse Slurm node list {nodelist!r}", op="init")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


class Slurm(Launcher):
    name = "slurm"

    @staticmethod
    def detect(env):
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env

    @staticmethod
    def placement(env):
        addr, port = _master(env)
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if addr is None and nodes:
            addr = first_slurm_host(nodes)
        if port is None and env.get("SLURM_JOB_ID"):
            port = 20000 + int(env["SLURM_JOB_ID"]) % 20000   # same on every task of the job
        return Placement(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                         _int(env, "SLURM_LOCALID"), addr, port, launcher="slurm")


# Order matters: torchrun's variables win (torchrun under Slurm), then MPI, then Slurm.
LAUNCHERS: list[type[Launcher]] = [Torchrun, OpenMPI, Hydra, Slurm]


def detect(env: dict | None = None) -> Placement:
    env = dict(os.environ) if env is None else env
    for launcher in LAUNCHERS:
        if launcher.detect(env):
            return launcher.placement(env)
    if "RANK" in env or "WORLD_SIZE" in env:
        return Torchrun.placement(env)   # half of the pair: init says which one is missing
    return Placement(*(None,) * 2, None, *_master(env))


def listen_socket(addr: str) -> socket.socket:
    """A TCP socket of the family of `addr` (IPv4 or IPv6), not yet bound."""
    return socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)


# A job's rendezvous port comes from below the kernel's ephemeral range: a port the kernel hands
# out for port 0, once closed again, can be taken by any process's listener or outgoing
# connection before the store binds it (torchrun failed with EADDRINUSE that way), while a port
# below the range is only ever taken by whoever asks for it by number.
_PORTS_GIVEN: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on every address now, never one this process handed out before."""
    low = max(1024, min(_ephemeral_low(), 65536) - 12000)
    for _ in range(1000):
        port = random.randrange(low, low + 12000)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    with socket.socket() as s:   # everything below the range is taken: the kernel's pick
        s.bind(("", 0))
        return s.getsockname()[1]


def routable_address() -> str:
    """An IPv4 address other hosts can reach us at (the host name's, else loopback)."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    return "127.0.0.1"


def _ipv4_of(ifname: str) -> str | None:
    """The IPv4 address of interface `ifname` (SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_of(ifname: str) -> str | None:
    """A global (not link-local) IPv6 address of interface `ifname`, or None."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    for row in rows:
        if len(row) == 6 and row[5] == ifname and not row[0].startswith("fe80"):
            return str(ipaddress.IPv6Address(bytes.fromhex(row[0])))
    return None


def matching_interfaces(spec: str, names: list[str]) -> list[str]:
    """The interfaces of `names` that COMM_SOCKET_IFNAME `spec` selects, in `names`' order, as
    NCCL_SOCKET_IFNAME reads it: comma-separated prefixes ("eth,ib" takes eth0, ib1, ...),
    "=" before the list for exact names, "^" before it to exclude instead ("^docker,lo")."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    wanted = [w for w in (spec[1:] if exact else spec).split(",") if w]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [n for n in names if hit(n) != exclude]


def interface_address(spec: str) -> str:
    """The address of the first interface COMM_SOCKET_IFNAME `spec` selects that has one
    (IPv4 first, else a global IPv6 address)."""
    names = [name for _, name in socket.if_nameindex()]
    chosen = matching_interfaces(spec, names)
    for name in chosen:
        addr = _ipv4_of(name) or _ipv6_of(name)
        if addr:
            return addr
    why = f"interfaces {', '.join(chosen)} have no address" if chosen else f"no interface matches (here: {', '.join(names)})"
    raise InvalidArgument(f"COMM_SOCKET_IFNAME={spec!r}: {why}", op="init")


def bind_address() -> str | None:
    """Where to bind listening sockets: COMM_BIND_ADDR, else the address of the interface
    COMM_SOCKET_IFNAME selects, else None (listen_address then picks the one that reaches
    MASTER_ADDR)."""
    addr = config.get("COMM_BIND_ADDR")
    if addr:
        return addr
    spec = config.get("COMM_SOCKET_IFNAME")
    return interface_address(spec) if spec else None


def listen_address(master_addr: str) -> str:
    """Where rank 0's rendezvous store listens: COMM_BIND_ADDR / COMM_SOCKET_IFNAME when set, else
    MASTER_ADDR itself when it is an address of this host (so MASTER_ADDR=127.0.0.1 keeps the
    store on loopback), else the local address our route to it starts from (a UDP connect
    sends nothing). A host name other than localhost that resolves to loopback here (Debian
    maps the host's own name to 127.0.1.1) may resolve to a real address on the other hosts:
    then every interface."""
    explicit = bind_address()
    if explicit:
        return explicit
    try:
        family, *_, sockaddr = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        raise InvalidArgument(f"MASTER_ADDR {master_addr!r} does not resolve ({e})", op="init") from None
    resolved = sockaddr[0]
    literal = resolved == master_addr or master_addr == "localhost"
    if ipaddress.ip_address(resolved).is_loopback and not literal:
        return "::" if family == socket.AF_INET6 else "0.0.0.0"
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((resolved, 0))
            return resolved        # an address of this host: exactly there
        except OSError:
            pass
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:                       # not ours (a NAT or service address): where the route leaves
            s.connect((resolved, 9))
            return s.getsockname()[0]
        except OSError as e:
            raise InvalidArgument(f"MASTER_ADDR {master_addr!r} is not reachable from here ({e.strerror})",
                                  op="init") from None


def host_id() -> str:
    """Ranks with the same host id share /dev/shm and may use shared memory. The network
    namespace is part of it, so ranks in two namespaces of one machine count as two hosts."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{netns}"
