"""torch.distributed's Store seen through comm.bootstrap.store.Store's interface: the torch backend's
communicators, and comm.init under torchrun (its agent already serves a TCPStore), bootstrap
through the store torch set up, with no second rendezvous port."""
from __future__ import annotations

import datetime
import itertools
import os
import socket

import torch.distributed as dist

from ..bootstrap import rendezvous
from ..core.errors import CommError, CommTimeout
from ..bootstrap.store import KeyValueStore

_joins = itertools.count()   # TorchStore.connect calls in this process

class TorchStore(KeyValueStore):
    """comm.bootstrap.store.Store's methods over a torch.distributed Store, so transports bootstrap through
    the store torch already set up for the group (no second rendezvous port)."""

    def __init__(self, store, rank: int, size: int, timeout: float):
        self._store, self.rank, self.size, self.timeout = store, rank, size, timeout

    @classmethod
    def connect(cls, addr: str, port: int, rank: int, size: int, timeout: float) -> "TorchStore":
        """A client of the TCPStore torchrun's agent serves on MASTER_PORT. That store outlives
        every world joined through it, so our keys live under comm/<restart count>/<join>/: an
        elastic restart never reads the previous attempt's, nor a second comm.init in one
        process (every rank counts its joins alike, as torch counts its groups) the first one's."""
        store = dist.TCPStore(addr, port, world_size=size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(dist.PrefixStore(f"comm/{attempt}/{next(_joins)}/", store), rank, size, timeout)

    def _fail(self, key: str, e: Exception) -> CommError:
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            return CommTimeout(f"key {key!r} did not appear in the store within {self.timeout:.0f} s "
                               "(a rank did not arrive)", rank=self.rank, op="bootstrap")
        return CommError(f"torch store failed on key {key!r}: {e}", rank=self.rank, op="bootstrap")

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = datetime.timedelta(seconds=self.timeout if timeout is None else timeout)
        try:
            self._store.wait([key], wait)
            return self._store.get(key)
        except RuntimeError as e:  # DistStoreError and friends
            raise self._fail(key, e) from None

    def all_gather(self, key: str, value: bytes) -> list[bytes]:
        """Three round trips whatever the group's size: set, wait for every key, one multi_get."""
        keys = [f"{key}/{r}" for r in range(self.size)]
        self.set(keys[self.rank], value)
        try:
            self._store.wait(keys, datetime.timedelta(seconds=self.timeout))
            return self._store.multi_get(keys)
        except RuntimeError as e:
            raise self._fail(key, e) from None

    def gather_some(self, key: str, value: bytes, want) -> dict[int, bytes]:
        """all_gather's three round trips, fetching the values of the ranks in `want` only."""
        want = sorted(set(want))
        keys = [f"{key}/{r}" for r in want]
        self.set(f"{key}/{self.rank}", value)
        try:
            self._store.wait(keys, datetime.timedelta(seconds=self.timeout))
            return dict(zip(want, self._store.multi_get(keys))) if keys else {}
        except RuntimeError as e:
            raise self._fail(key, e) from None

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def local_address(self) -> str:
        """An address the other ranks can reach us at: the one our route to the store's host
        starts from (a UDP connect sends nothing); without a TCP store, the host name's."""
        store = self._store
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        if isinstance(store, dist.TCPStore):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    s.connect((store.host, store.port))
                    return s.getsockname()[0]
                except OSError:
                    pass
        return rendezvous.routable_address()

    def scoped(self, prefix: str, rank: int | None = None, size: int | None = None) -> TorchStore:
        return TorchStore(dist.PrefixStore(f"{prefix}/", self._store), self.rank if rank is None else rank,
                          self.size if size is None else size, self.timeout)

    def close(self) -> None:
        """torch owns the store."""
