"""The last operations of a communicator, dumped when one fails so a hang has a culprit.

Each entry is (seq, op, dtype, count, root/peer, state, seconds since posted). Recording is one
deque append per operation; the dump goes to COMM_FLIGHT_RECORDER (appended) or stderr.
A transport with lean call paths that bypass this (the native engine's) keeps its own record
and hands it over as `engine_ops`; the dump shows both.
"""
from __future__ import annotations

import collections
import sys
import time

from .core import config
from .core.ops import OpKind
from .core.types import DType

DEPTH = 64
SHOWN = 8      # entries per list on stderr


class FlightRecorder:
    __slots__ = ("_entries", "_rank", "_group", "_engine_ops")

    def __init__(self, rank: int, group: str, engine_ops=None):
        self._entries: collections.deque = collections.deque(maxlen=DEPTH)
        self._rank = rank
        self._group = group
        # () -> [(seq, kind, dtype, count, root, state, started)]: the transport's own record
        self._engine_ops = engine_ops

    def posted(self, desc) -> list:
        """Record a posted op; the caller updates entry[5] (state). Names are formatted only
        at dump time: this runs on every call."""
        entry = [desc.seq, desc.kind, desc.dtype, desc.count,
                 desc.root if desc.peer < 0 else desc.peer, "posted", time.monotonic()]
        self._entries.append(entry)
        return entry

    def dump(self, reason: str) -> str:
        """Write the record: all of it to COMM_FLIGHT_RECORDER, else the last SHOWN entries of
        each list to stderr (every survivor of a failure dumps; a screenful each is plenty)."""
        now = time.monotonic()
        path = config.get("COMM_FLIGHT_RECORDER")
        lines = [f"comm flight recorder: rank {self._rank} of group {self._group}: {reason}",
                 "  seq  op              dtype      count  root/peer  state      age(s)"]
        sections = [("", list(self._entries))]
        if self._engine_ops is not None:
            sections.append(("  the engine's collectives (every call path, its own seq):",
                             [(seq, OpKind(k), DType(d), count, root, state, t)
                              for seq, k, d, count, root, state, t in self._engine_ops()]))
        for title, entries in sections:
            if title:
                lines.append(title)
            if not path and len(entries) > SHOWN:
                lines.append(f"  ... {len(entries) - SHOWN} earlier (COMM_FLIGHT_RECORDER=<file> keeps them all)")
                entries = entries[-SHOWN:]
            for seq, op, dtype, count, who, state, t in entries:
                lines.append(f"  {seq:<4} {op.name.lower():<15} {dtype.name.lower():<9} {count:>7}  {who:>9}  "
                             f"{state:<9} {now - t:8.3f}")
        text = "\n".join(lines) + "\n"
        if path:
            with open(path, "a") as f:
                f.write(text)
        else:
            sys.stderr.write(text)
        return text
