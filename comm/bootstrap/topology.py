"""Which ranks share a host: `Communicator.topology`.

Hosts are told apart by the host id that also decides shared memory (comm.bootstrap.rendezvous.host_id:
host name, boot id and network namespace). Hosts are numbered by their lowest rank and the
ranks of a host ascend, so every rank derives the same view; any placement works (block,
cyclic, uneven, one rank per host, one host). The native engine gets the same grouping and
picks its two-level algorithms from it (native/src/algorithms/README.md).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """The hosts of a communicator and the ranks on each, as seen from `rank`."""

    hosts: tuple[tuple[int, ...], ...]   # ranks of each host, hosts in order of their lowest rank
    rank: int

    @classmethod
    def from_host_ids(cls, host_ids, rank: int) -> "Topology":
        """host_ids[r]: the host id of rank r (any hashable; equal ids, same host)."""
        by_host: dict = {}
        for r, h in enumerate(host_ids):
            by_host.setdefault(h, []).append(r)
        return cls(tuple(tuple(ranks) for ranks in by_host.values()), rank)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def host(self) -> int:
        """The index of this rank's host in `hosts`."""
        return self.host_of(self.rank)

    def host_of(self, rank: int) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if rank in ranks)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's host (this one included)."""
        return self.hosts[self.host]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def leaders(self) -> tuple[int, ...]:
        """One rank per host, the lowest."""
        return tuple(ranks[0] for ranks in self.hosts)

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def hierarchical(self) -> bool:
        """Spans hosts with several ranks on some host: the two-level algorithms apply."""
        return self.num_hosts > 1 and any(len(ranks) > 1 for ranks in self.hosts)

    def __str__(self) -> str:
        hosts = " | ".join(",".join(map(str, ranks)) for ranks in self.hosts)
        return (f"{self.num_hosts} host(s) [{hosts}]; this rank is local rank {self.local_rank} of "
                f"{self.local_size} on host {self.host}")
