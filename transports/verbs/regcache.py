"""Memory-registration cache: registering memory with the NIC costs tens of microseconds to
milliseconds (pages are pinned), so registrations are kept and reused. Pure logic: the actual
ibv_reg_mr / dmabuf calls are passed in.

- Keyed by address range; a lookup hits any registration that covers the requested range, so
  slices of one array share its registration (the whole owning allocation is registered).
- Each entry holds a reference to the array that owns the memory. That is what keeps the
  cache correct: memory cannot be freed and reused at the same address (with other physical
  pages) while a registration for it exists.
- Least recently used entries are evicted beyond `max_entries` or `max_bytes`, except
  entries in use by an operation in flight (pinned by acquire, unpinned by release).
- Memory whose owner is unknown (owner=None: a view of a buffer that only the caller keeps
  alive) is cached only while the caller vouches for it: drop_unowned() at the end of the
  operation deregisters those entries.
- clear() deregisters everything (close).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Registration:
    start: int
    end: int
    lkey: int
    rkey: int
    iova_start: int        # the MR's address for `start` (differs from it for dma-buf MRs)
    handle: object         # the pyverbs MR, for deregistration
    owner: object = None   # keeps the registered memory alive
    pins: int = field(default=0)

    def iova(self, addr: int) -> int:
        """The address to put in a work request (local SGE or remote write) for `addr`."""
        return self.iova_start + (addr - self.start)


# register(start, length, device) -> (handle, lkey, rkey, iova_start); deregister(handle)
RegisterFn = Callable[[int, int, str], tuple[object, int, int, int]]


class RegistrationCache:
    def __init__(self, register: RegisterFn, deregister: Callable[[object], None], *,
                 max_entries: int = 64, max_bytes: int = 4 << 30):
        self._register = register
        self._deregister = deregister
        self._entries: OrderedDict[tuple[int, int], Registration] = OrderedDict()
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def registered_bytes(self) -> int:
        return sum(r.end - r.start for r in self._entries.values())

    def acquire(self, addr: int, length: int, *, region: tuple[int, int] | None = None,
                owner: object = None, device: str = "cpu") -> Registration:
        """A registration covering [addr, addr+length), pinned until release(). On a miss,
        `region` (the owning allocation, default the range itself) is registered. Verbs refuses
        empty registrations: callers send empty messages from their own scratch region."""
        if length <= 0:
            raise ValueError("a registration needs at least one byte")
        for key, reg in self._entries.items():
            if reg.start <= addr and addr + length <= reg.end:
                self._entries.move_to_end(key)
                self.hits += 1
                reg.pins += 1
                return reg
        self.misses += 1
        start, end = region if region is not None else (addr, addr + length)
        if not (start <= addr and addr + length <= end):
            raise ValueError(f"region [{start:#x}, {end:#x}) does not contain the range to register")
        handle, lkey, rkey, iova_start = self._register(start, end - start, device)
        reg = Registration(start, end, lkey, rkey, iova_start, handle, owner, pins=1)
        self._entries[(reg.start, reg.end)] = reg
        self._evict()
        return reg

    def release(self, reg: Registration) -> None:
        if reg.pins <= 0:
            raise ValueError("release() of a registration that is not acquired")
        reg.pins -= 1
        self._entries.move_to_end((reg.start, reg.end))   # an operation just used it
        self._evict()

    def _evict(self) -> None:
        total = self.registered_bytes
        for key in list(self._entries):
            if len(self._entries) <= self.max_entries and total <= self.max_bytes:
                return
            reg = self._entries[key]
            if reg.pins:
                continue   # in flight: the NIC may still touch it
            del self._entries[key]
            total -= reg.end - reg.start
            self._deregister(reg.handle)

    def drop_unowned(self) -> None:
        """Deregister idle entries with no owner (their memory may be freed after this)."""
        for key, reg in list(self._entries.items()):
            if reg.owner is None and not reg.pins:
                del self._entries[key]
                self._deregister(reg.handle)

    def clear(self) -> None:
        """Deregister everything (on close: the protection domain goes next)."""
        entries, self._entries = list(self._entries.values()), OrderedDict()
        for reg in entries:
            self._deregister(reg.handle)
