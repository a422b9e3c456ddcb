"""Every COMM_* environment variable, declared once with its default and its meaning.

Read them through `get(name)`; the README's table is generated from `VARIABLES` (see
`python -m comm.config`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    doc: str
    parse: Callable[[str], object] = str


def _opt_str(s: str) -> str | None:
    return s or None


VARIABLES: dict[str, Variable] = {v.name: v for v in [
    Variable("COMM_TRANSPORT", "native", "Transport used by init(transport='auto'): native, mpi, ucx, nccl, verbs."),
    Variable("COMM_TIMEOUT", "300", "Seconds every operation may take before CommTimeout (also init's default).", float),
    Variable("COMM_ALGO", "", "Force an algorithm where one of that name fits: ring, tree, rd (recursive doubling), direct and cma (shared memory), linear, pairwise, dissemination (native); ring, rd, tree (ucx, verbs). Empty: choose by size and topology.", _opt_str),
    Variable("COMM_CHANNELS", "auto", "Native channels: auto (shared memory inside a host, TCP across), or tcp (TCP only)."),
    Variable("COMM_SOCKETS_PER_PEER", "2", "TCP sockets per remote peer; large messages are striped over them.", int),
    Variable("COMM_CHUNK_BYTES", "524288", "Pipelining chunk of the native ring algorithms, in bytes.", int),
    Variable("COMM_SECRET", "", "Shared job secret: every connection proves it with an HMAC challenge. Empty: unauthenticated (a warning says so).", _opt_str),
    Variable("COMM_BIND_ADDR", "", "Address to bind listening sockets to (default: the one that reaches the rendezvous).", _opt_str),
    Variable("COMM_IFNAME", "", "Network interface to bind to (its IPv4 address is used), e.g. eth0.", _opt_str),
    Variable("COMM_FLIGHT_RECORDER", "", "File to which each rank appends its last operations when an operation fails; empty: stderr.", _opt_str),
    Variable("COMM_VERBS_DEVICE", "", "RDMA device (and port) for the verbs transport, e.g. mlx5_0 or mlx5_0:1. Empty: the first active port.", _opt_str),
    Variable("COMM_VERBS_GID_INDEX", "-1", "GID table index for the verbs transport (RoCE needs one; RoCEv2 is often 3). -1: the first non-zero GID of the port.", int),
    Variable("COMM_VERBS_HOP_LIMIT", "64", "IP hop limit (TTL) of the verbs transport's RoCE v2 / routed InfiniBand packets; 1 keeps them inside one subnet.", int),
    Variable("COMM_MPI_BOUNDED", "1", "1: the mpi transport runs blocking operations as non-blocking ones polled against COMM_TIMEOUT, so a hung peer is an error, not a hang. 0: MPI's blocking calls (a few us faster; they cannot time out).", lambda s: s not in ("", "0")),
    Variable("COMM_DEBUG", "0", "1: log connection set-up and algorithm choices to stderr.", lambda s: s not in ("", "0")),
]}


def get(name: str):
    """The parsed value of a declared variable (environment, else its default)."""
    var = VARIABLES[name]
    return var.parse(os.environ.get(name, var.default))


def markdown_table() -> str:
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | `{v.default}` | {v.doc} |" for v in VARIABLES.values()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
