"""The last operations of a communicator, dumped when one fails so a hang has a culprit.

Each entry is (seq, op, dtype, count, root/peer, state, seconds since posted). Recording is one
deque append per operation; the dump goes to COMM_FLIGHT_RECORDER (appended) or stderr.
"""
from __future__ import annotations

import collections
import sys
import time

from . import config

DEPTH = 64


class FlightRecorder:
    __slots__ = ("_entries", "_rank", "_group")

    def __init__(self, rank: int, group: str):
        self._entries: collections.deque = collections.deque(maxlen=DEPTH)
        self._rank = rank
        self._group = group

    def posted(self, desc) -> list:
        """Record a posted op; the caller updates entry[5] (state). Names are formatted only
        at dump time: this runs on every call."""
        entry = [desc.seq, desc.kind, desc.dtype, desc.count,
                 desc.root if desc.peer < 0 else desc.peer, "posted", time.monotonic()]
        self._entries.append(entry)
        return entry

    def dump(self, reason: str) -> str:
        now = time.monotonic()
        lines = [f"comm flight recorder: rank {self._rank} of group {self._group}: {reason}",
                 "  seq  op              dtype      count  root/peer  state      age(s)"]
        for seq, op, dtype, count, who, state, t in self._entries:
            lines.append(f"  {seq:<4} {op.name.lower():<15} {dtype.name.lower():<9} {count:>7}  {who:>9}  "
                         f"{state:<9} {now - t:8.3f}")
        text = "\n".join(lines) + "\n"
        path = config.get("COMM_FLIGHT_RECORDER")
        if path:
            with open(path, "a") as f:
                f.write(text)
        else:
            sys.stderr.write(text)
        return text
