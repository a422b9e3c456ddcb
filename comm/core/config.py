"""Every COMM_* environment variable, declared once with its default, its meaning and what
it accepts.

Read them through `get(name)`: a value that does not parse is an InvalidArgument naming the
variable and what it accepts (never a silent fallback to the default). An empty value counts
as unset. The README keeps one line per variable; `python -m comm.core.config` prints them in full.
"""
from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass
from typing import Callable

from .errors import InvalidArgument


# The transports this library knows, each the module transports/<name>: the names COMM_TRANSPORT
# and init(transport=) accept, and those transports.base's registry imports. Declared here, below
# the transports, so that checking the variable needs no transport imported.
TRANSPORTS = ("native", "mpi", "ucx", "nccl", "verbs")


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    doc: str
    parse: Callable[[str], object] = str   # raises ValueError(what it accepts) on a bad value


def _opt_str(s: str) -> str | None:
    return s or None


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(s: str) -> str:
        if s not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return s
    return parse


def _flag(s: str) -> bool:
    if s not in ("0", "1"):
        raise ValueError("0 or 1")
    return s == "1"


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            value = int(s)
        except ValueError:
            value = None
        if value is None or value < low:
            raise ValueError(f"an integer >= {low}")
        return value
    return parse


def _seconds(allow_zero: bool) -> Callable[[str], float]:
    what = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"

    def parse(s: str) -> float:
        try:
            value = float(s)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > 0 or allow_zero and value == 0)):
            raise ValueError(f"{what}, e.g. 300 or 0.5 (no unit suffix)")
        return value
    return parse


def algorithm_names() -> dict[str, list[str]]:
    """The names COMM_ALGO may take, per transport that reads it: the engine's, which runs the
    algorithms of every engine transport."""
    try:
        from .. import _native
    except ImportError:   # the engine is not built: no transport here chooses an algorithm
        return {}
    return {"native, ucx, verbs": list(_native.algorithm_names())}


def _algo(s: str) -> str:
    names = algorithm_names()
    if not any(s in group for group in names.values()):
        listed = "; ".join(f"{t}: {', '.join(n)}" for t, n in names.items())
        raise ValueError(f"an algorithm name ({listed}), or empty to choose by size")
    return s


def _ip(s: str) -> str:
    try:
        ipaddress.ip_address(s)
    except ValueError:
        raise ValueError("an IPv4 or IPv6 address of this host, e.g. 10.0.0.5 or fd00::5") from None
    return s


def _ifnames(s: str) -> str:
    names = s.lstrip("^").lstrip("=").split(",")
    if not all(names) or any(len(n) > 15 or "/" in n or " " in n for n in names):
        raise ValueError("interface names or prefixes, comma-separated, e.g. eth0, eth,ib, =eth0 or ^docker,lo")
    return s


VARIABLES: dict[str, Variable] = {v.name: v for v in [
    Variable("COMM_TRANSPORT", "native", f"Transport used by init(transport='auto'): {', '.join(TRANSPORTS)}.", _one_of(*TRANSPORTS)),
    Variable("COMM_TIMEOUT", "300", "Seconds every operation may take before CommTimeout (also init's default).", _seconds(False)),
    Variable("COMM_ALGO", "", "Force an algorithm where one of that name fits (native, ucx, verbs: the engine's): ring, tree, rd (recursive doubling), direct and cma (shared memory), tuned (all_reduce on one host: ring or cma, whichever runs faster here, measured), linear, pairwise, dissemination, twolevel (across hosts: shared memory inside each), or flat (the automatic choice without twolevel). Empty: choose by size and topology. Any other name is an error.", lambda s: _algo(s) if s else None),
    Variable("COMM_CHANNELS", "auto", "Native channels: auto (shared memory inside a host, TCP across), or tcp (TCP only).", _one_of("auto", "tcp")),
    Variable("COMM_CMA", "1", "1: ranks on one host copy between each other's memory directly (process_vm_readv / writev: the single-copy collectives and windows) where the kernel allows it; 0: never (shared-memory rings only). Every rank must use the same.", _flag),
    Variable("COMM_CONNECT", "lazy", "Native connections: lazy (at set-up only the peers the algorithms use: this host, ring neighbours, the same local rank on other hosts, tree and recursive-doubling partners; any other peer when an operation first needs it) or eager (every peer at set-up, a full mesh). Every rank must use the same.", _one_of("lazy", "eager")),
    Variable("COMM_SOCKETS_PER_PEER", "2", "Connections per remote peer (TCP sockets; UCX endpoints on the collective stream); large messages are striped over them. Two ranks set apart use the fewer.", _int_at_least(1)),
    Variable("COMM_CHUNK_BYTES", "524288", "Pipelining chunk of the engine's ring and tree algorithms (native, ucx, verbs), in bytes.", _int_at_least(1)),
    Variable("COMM_SECRET", "", "Shared job secret: every connection proves it with an HMAC challenge. Empty: unauthenticated (a warning says so).", _opt_str),
    Variable("COMM_BIND_ADDR", "", "IPv4 or IPv6 address to bind listening sockets to (default: the one that reaches MASTER_ADDR; loopback when it is loopback).", lambda s: _ip(s) if s else None),
    Variable("COMM_SOCKET_IFNAME", "", "Network interfaces to listen on, as NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: comma-separated name prefixes (eth,ib), =names for exact ones, ^ to exclude (^docker,lo); the first that has an address is used (IPv4, else IPv6). Empty: the interface whose route reaches MASTER_ADDR.", lambda s: _ifnames(s) if s else None),
    Variable("COMM_FLIGHT_RECORDER", "", "File to which each rank appends its last operations when an operation fails; empty: the last 8 of them on stderr.", _opt_str),
    Variable("COMM_VERBS_DEVICE", "", "RDMA device (and port) for the verbs transport, e.g. mlx5_0 or mlx5_0:1. Empty: the first active port.", _opt_str),
    Variable("COMM_VERBS_GID_INDEX", "-1", "GID table index for the verbs transport (RoCE needs one; RoCEv2 is often 3). -1: the first non-zero GID of the port.", _int_at_least(-1)),
    Variable("COMM_VERBS_HOP_LIMIT", "64", "IP hop limit (TTL) of the verbs transport's RoCE v2 / routed InfiniBand packets; 1 keeps them inside one subnet.", _int_at_least(1)),
    Variable("COMM_MPI_BOUNDED", "1", "1: the mpi transport runs blocking operations as non-blocking ones polled against COMM_TIMEOUT, so a hung peer is an error, not a hang. 0: MPI's blocking calls (a few us faster; they cannot time out).", _flag),
    Variable("COMM_REPORT_INTERVAL", "10", "Seconds between rank 0's reports, while init waits, of the ranks that have not joined yet and where the others came from. 0: no reports.", _seconds(True)),
    Variable("COMM_COMPRESS", "auto", "Calls with compress='bf16' / 'fp8' (comm.compress): auto (where the communicator spans hosts and the message holds at least COMM_COMPRESS_MIN_BYTES, if the first calls of that size measure it faster than the exact path), on (there, without measuring), force (always, one host too), off (never: the exact path). Every rank must use the same.", _one_of("auto", "on", "force", "off")),
    Variable("COMM_COMPRESS_MIN_BYTES", "4194304", "Smallest message (bytes of the caller's data) that compress= compresses across hosts; below it the exact path runs (latency, not the link, bounds small messages: at 2 Gbit/s compression measured slower at 1 MiB, even at 4 MiB, faster from 16 MiB).", _int_at_least(0)),
    Variable("COMM_COMPRESS_BLOCK", "256", "Elements per float32 scale of compress='fp8' (smaller: more accurate, more scale bytes on the wire, 4 per block). Every rank must use the same.", _int_at_least(1)),
    Variable("COMM_WINDOW_RMA", "0", "1: windows reach peers of a net with remote memory access through it (UCX: ucp_put_nbx / ucp_get_nbx on exchanged rkeys; verbs: RDMA WRITE / READ through registered staging on the p2p queue pair, not yet run on RDMA hardware; signals stay messages); 0: through messages on the p2p stream that the target's engine writes in, as on TCP. 0 by default: without RDMA hardware UCX emulates RMA, measured 3-15x slower than the messages on one host, and its emulation writes wherever a peer's request says (docs/one-sided.md). Ranks may differ: one with 0 reaches, and is reached by, messages only. 1 also opens UCX with RMA and its p2p worker in thread mode MULTI.", _flag),
    Variable("COMM_DEBUG", "0", "1: log set-up (rendezvous, transport, connections) and each algorithm's first use to stderr.", _flag),
]}


def get(name: str):
    """The parsed value of a declared variable (environment, else its default)."""
    var = VARIABLES[name]
    raw = os.environ.get(name) or var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise InvalidArgument(f"{name}={raw!r} is not valid: expected {e}") from None


def check_environment() -> None:
    """Parse every COMM_* variable that is set, so a bad value fails init at once, whether or
    not the chosen transport ever reads it."""
    for name in VARIABLES:
        if os.environ.get(name):
            get(name)


def markdown_table() -> str:
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | `{v.default}` | {v.doc} |" for v in VARIABLES.values()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
