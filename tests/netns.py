"""Two 'hosts' on one machine: network namespaces joined by a veth pair (198.18.0.0/15, the
range set aside for benchmarking). Needs root and iproute2; tests skip with the reason otherwise."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid

ADDRS = ["198.18.0.1", "198.18.0.2"]


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"commprobe{uuid.uuid4().hex[:6]}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "cannot create network namespaces here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class TwoHosts:
    """Namespaces h0 and h1 with veth ends v0 (198.18.0.1) and v1 (198.18.0.2)."""

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.ns = [f"comm{tag}h0", f"comm{tag}h1"]
        self.dev = [f"v{tag}a", f"v{tag}b"]
        for ns in self.ns:
            _ip("netns", "add", ns)
        _ip("link", "add", self.dev[0], "netns", self.ns[0], "type", "veth",
            "peer", "name", self.dev[1], "netns", self.ns[1])
        for ns, dev, addr in zip(self.ns, self.dev, ADDRS):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def tx_bytes(self, host: int) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.ns[host], "cat",
                              f"/sys/class/net/{self.dev[host]}/statistics/tx_bytes"],
                             check=True, capture_output=True, text=True).stdout
        return int(out)

    def cut(self, host: int = 0) -> None:
        _ip("-n", self.ns[host], "link", "set", self.dev[host], "down")

    def limit(self, rate: str = "100mbit") -> None:
        """A slower link: token bucket on both ends (tc has tbf here, no netem)."""
        for ns, dev in zip(self.ns, self.dev):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                            "rate", rate, "burst", "256kb", "latency", "50ms"], check=True, capture_output=True)

    def close(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
