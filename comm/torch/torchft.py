"""torchft's reconfigurable process group on this library: ``ProcessGroupComm`` has the shape of
torchft's ProcessGroupGloo (``configure(store_addr, replica_id, rank, world_size, ...)`` makes a
fresh group over the store at ``host:port/prefix`` for every quorum), so torchft's Manager,
DDP and LocalSGD run their replica groups over "comm". Needs ``pip install torchft``."""
from __future__ import annotations

from torchft.process_group import ProcessGroupWrapper

from . import backend


class ProcessGroupComm(ProcessGroupWrapper):
    def _create_pg(self, store, rank: int, world_size: int) -> backend.ProcessGroupComm:
        # each quorum gets its own name: its communicators' store keys and torch's tables differ
        name = f"torchft_comm_{self._quorum_id}_{self._replica_id}"
        return backend.ProcessGroupComm(store, rank, world_size, self._timeout, name,
                                        self._global_ranks or list(range(world_size)))

    def getBackendName(self) -> str:
        return "torchft-comm"
