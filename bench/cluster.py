"""A cluster on one machine: H "hosts", each a network namespace with its own address, joined
by veth links to a bridge that lives in a namespace of its own (nothing is added to the
machine's own network, so parallel clusters cannot collide). Each host's link can be limited
to a rate (tc tbf on both directions). Ranks started in a host's namespace see a host of
their own: comm's host id includes the network namespace, so they share memory with the
ranks of their host only and reach the others over TCP, as on real machines.

Used by the multi-host tests and by `python -m bench --hosts H --np L`. Needs root
(CAP_NET_ADMIN) and iproute2; `unavailable()` says why not otherwise.

    with NetnsCluster(2, link_rate="2gbit") as cluster:
        procs = cluster.launch([sys.executable, "train.py"], per_host=2)

Addresses come from 198.18.0.0/15, the range set aside for benchmarking.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import uuid

SUBNET = "198.18.0"   # host h is SUBNET.(h+1)/24


_PROBE = "commprobe"   # + the creating process's pid: a probe whose creator is gone is stale


def _remove_stale_probes() -> None:
    """Delete probe namespaces left by a process killed between creating and deleting its own."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listing.splitlines() if line.strip()):
        pid = name[len(_PROBE):]
        if name.startswith(_PROBE) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@functools.cache
def unavailable() -> str | None:
    """Why a cluster cannot be built here, or None (probed once per process)."""
    if os.geteuid() != 0:
        return "a simulated cluster needs root (CAP_NET_ADMIN) for network namespaces"
    if shutil.which("ip") is None:
        return "a simulated cluster needs iproute2 (ip), which is not installed"
    _remove_stale_probes()
    probe = f"{_PROBE}{os.getpid()}"
    try:
        if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
            return "cannot create network namespaces here"
    finally:   # also after a failed add, which can leave the name behind
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def rate_bits(rate: str) -> int:
    """'2gbit', '500mbit', '100kbit', '1000000' (bit/s) -> bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit)?", rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: expected e.g. 2gbit, 500mbit or a number of bit/s")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def link_bound(benchmark: str, hosts: int, per_host: int, rate: str) -> float | None:
    """The highest busbw (GB/s, nccl-tests' factors) that links of `rate` each way allow for
    `benchmark` on hosts x per_host ranks, counting what must leave each host: an all_reduce
    sends 2(H-1)/H of the buffer out of every host, reduce_scatter / all_gather (H-1)/H of the
    whole, all_to_all per_host (H-1)/H of one rank's buffer, broadcast / reduce the buffer once,
    and the one-sided ring benchmarks (put, get, kv) the buffer once, one rank per host.
    None for benchmarks it does not know. Raw link rate: TCP/IP headers take ~4% of it."""
    n, link = hosts * per_host, rate_bits(rate) / 8 / 1e9
    if hosts < 2:
        return None
    if benchmark in ("all_reduce", "reduce_scatter", "all_gather", "decode"):
        return (n - 1) / n * hosts / (hosts - 1) * link
    if benchmark in ("all_to_all", "all_to_all_v"):
        return (n - 1) / n * hosts / ((hosts - 1) * per_host) * link
    if benchmark in ("broadcast", "reduce"):
        return link
    if benchmark in ("put", "get", "kv"):   # a ring: one rank of each host sends across, each way
        return link
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class NetnsCluster:
    """`hosts` namespaces with veth links to a bridge; host h has address addr(h)."""

    def __init__(self, hosts: int, link_rate: str | None = None):
        if not 1 <= hosts <= 250:
            raise ValueError("hosts: 1 to 250")
        tag = uuid.uuid4().hex[:6]
        self.hosts, self.link_rate = hosts, link_rate
        self.bridge_ns = f"comm{tag}br"
        self.ns = [f"comm{tag}h{h}" for h in range(hosts)]
        self.dev = "eth0"                        # each host's end, inside its namespace
        self._port = [f"p{h}" for h in range(hosts)]  # the bridge's ends, inside bridge_ns
        try:
            _ip("netns", "add", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for h, ns in enumerate(self.ns):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "add", self.dev, "type", "veth", "peer", "name", self._port[h],
                    "netns", self.bridge_ns)
                _ip("-n", self.bridge_ns, "link", "set", self._port[h], "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", self.dev)
                _ip("-n", ns, "link", "set", self.dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if link_rate:
                    self._limit(ns, self.dev, link_rate)                       # host -> bridge
                    self._limit(self.bridge_ns, self._port[h], link_rate)      # bridge -> host
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _limit(ns: str, dev: str, rate: str) -> None:
        # The bucket holds ~8 ms of traffic (at least 64 KiB): enough for the kernel's
        # segmentation-offloaded packets at any rate, small against a benchmark's seconds.
        burst = max(64 << 10, rate_bits(rate) // 8 // 125)
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                            "rate", str(rate_bits(rate)), "burst", str(burst), "latency", "50ms"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tc qdisc add dev {dev} (netns {ns}) tbf: {r.stderr.strip()}")

    def addr(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def exec_prefix(self, host: int) -> list[str]:
        """Prefix a command with this to run it on `host`."""
        return ["ip", "netns", "exec", self.ns[host]]

    def placement(self, per_host: int | list[int], cyclic: bool = False) -> list[int]:
        """The host of each rank: `per_host` ranks on every host (a list: that many on each),
        in blocks (0,1 | 2,3) or cyclic (0,2 | 1,3), as Slurm's block and cyclic distributions."""
        counts = [per_host] * self.hosts if isinstance(per_host, int) else list(per_host)
        if len(counts) != self.hosts:
            raise ValueError(f"{len(counts)} rank counts for {self.hosts} hosts")
        if not cyclic:
            return [h for h, k in enumerate(counts) for _ in range(k)]
        hosts, left = [], list(counts)
        while any(left):
            for h in range(self.hosts):
                if left[h]:
                    hosts.append(h)
                    left[h] -= 1
        return hosts

    def rank_env(self, hosts_of_ranks: list[int], master_port: int) -> list[dict[str, str]]:
        """torchrun's variables for each rank of a placement (MASTER_ADDR: host 0's address)."""
        out = []
        for r, h in enumerate(hosts_of_ranks):
            local = [q for q, hq in enumerate(hosts_of_ranks) if hq == h]
            out.append({"RANK": str(r), "WORLD_SIZE": str(len(hosts_of_ranks)),
                        "LOCAL_RANK": str(local.index(r)), "LOCAL_WORLD_SIZE": str(len(local)),
                        "GROUP_RANK": str(h), "MASTER_ADDR": self.addr(hosts_of_ranks[0]),
                        "MASTER_PORT": str(master_port)})
        return out

    def launch(self, cmd: list[str], per_host: int | list[int], env: dict | None = None, *,
               cyclic: bool = False, master_port: int = 29500) -> list[subprocess.Popen]:
        """Start `cmd` once per rank, each in its host's namespace with the launcher env set."""
        hosts_of_ranks = self.placement(per_host, cyclic)
        base = dict(os.environ if env is None else env)
        return [subprocess.Popen(self.exec_prefix(h) + cmd, env=dict(base, **e), start_new_session=True)
                for h, e in zip(hosts_of_ranks, self.rank_env(hosts_of_ranks, master_port))]

    def tx_bytes(self, host: int) -> int:
        """Bytes `host` has sent on its link."""
        out = subprocess.run(self.exec_prefix(host) + ["cat", f"/sys/class/net/{self.dev}/statistics/tx_bytes"],
                             check=True, capture_output=True, text=True).stdout
        return int(out)

    def cut(self, host: int) -> None:
        """Take `host`'s link down (ip link set down): its packets go nowhere."""
        _ip("-n", self.ns[host], "link", "set", self.dev, "down")

    def restore(self, host: int) -> None:
        """Bring a cut link back up."""
        _ip("-n", self.ns[host], "link", "set", self.dev, "up")

    def close(self) -> None:
        for ns in [*self.ns, self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
