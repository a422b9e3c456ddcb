"""Fault-tolerant agreement, decided by the store's host (comm.bootstrap.store.StoreServer).

ULFM's MPIX_Comm_agree over a coordinator: every live member of a communicator sends its
flag and the failures it saw first hand; the host decides once every member has either
contributed or is known to be gone (its store connection dropped, a contributor saw its
process die, or it was excluded earlier), or, at the deadline, declares the members still
missing failed (a hung, SIGSTOPped rank). The decision (the AND of the live members' flags,
and the failed set) is final: later contributions to the same instance get it unchanged,
and the failed ranks are excluded from the job (the host refuses them from then on).

A rank returns a decision only after a second round, the acknowledgement: the host answers
it once every live member has acknowledged (so has the decision). If the host dies, the
survivors move to a new host (comm.elastic) and replay, acknowledged, the decisions they have
seen: a rank that had the decision returns it after the replay, and one that had not gets it
there. No rank can have returned without every other survivor holding the decision (the host
answers the acknowledgement only then), so no survivor is left to decide anew alone.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

KEEP = 4096   # decisions remembered: enough for any instance a straggler may still ask about


@dataclass
class _Open:
    members: frozenset[int]
    deadline: float
    flags: dict[int, int] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)   # failures contributors saw themselves


class Agreements:
    """The host's agreement instances. Every method runs with the server's lock held."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}
        self.decided: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.excluded: set[int] = set()   # every rank any decision declared failed
        self.acks: dict[str, set[int]] = {}

    def adopt(self, key: str, decision: dict) -> dict:
        """Take a decision made by an earlier host (replayed by a survivor)."""
        if key not in self.decided:
            self._record(key, {"flag": int(decision["flag"]), "failed": sorted(map(int, decision["failed"]))})
        return self.decided[key]

    def contribute(self, key: str, uid: int, msg: dict, timeout: float) -> _Open | None:
        """Add uid's contribution (or acknowledgement); None when the instance is decided."""
        if msg.get("decided") is not None:
            self.adopt(key, msg["decided"])
        if msg.get("ack"):
            self.acks.setdefault(key, set()).add(uid)
        if key in self.decided or msg.get("ack"):
            return None
        inst = self._open.get(key)
        if inst is None:
            inst = self._open[key] = _Open(frozenset(map(int, msg["members"])), time.monotonic() + timeout)
        inst.flags[uid] = int(msg["flag"])
        inst.reported.update(r for r in map(int, msg["failed"]) if r in inst.members and r != uid)
        return inst

    def acknowledged(self, key: str, members, gone) -> bool:
        """Whether every member the decision counts live has acknowledged it (or is gone)."""
        failed, acks = set(self.decided[key]["failed"]), self.acks.get(key, ())
        return all(m in acks or m in failed or gone(m) for m in members)

    def ready(self, key: str, inst: _Open, gone) -> bool:
        """Whether the instance can be decided: every member contributed or is known gone."""
        return key in self.decided or all(m in inst.flags or m in inst.reported or gone(m)
                                          for m in inst.members)

    def decide(self, key: str, inst: _Open, gone) -> dict:
        """Decide now: members missing (at the deadline), reported or gone are failed."""
        if key not in self.decided:
            failed = {m for m in inst.members if m not in inst.flags or m in inst.reported or gone(m)}
            flag = -1
            for m, f in inst.flags.items():
                if m not in failed:
                    flag &= f
            self._record(key, {"flag": flag, "failed": sorted(failed)})
        self._open.pop(key, None)
        return self.decided[key]

    def _record(self, key: str, decision: dict) -> None:
        self.decided[key] = decision
        self.excluded.update(decision["failed"])
        while len(self.decided) > KEEP:
            old, _ = self.decided.popitem(last=False)
            self.acks.pop(old, None)
